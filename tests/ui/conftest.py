"""Fixtures of the UI tests: a database filled by a real training run, an empty one, and the
app run in-process by Streamlit's AppTest.

The real run is `scaletrain run` on 2 CPU ranks for 12 steps with a checkpoint every 4 (the
embedded stack: telemetry, ckptd with memory, SSD and S3 tiers), rank 1 made a straggler and a
gradient bit flipped on rank 0 at step 6, so that every section of the health page has something
real to show. It takes ~20 s, once per session.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import streamlit as st
from ui_testing import RUN, RealRun

from telemetry.db import connect, migrate
from ui.source import DB_ENV


@pytest.fixture(scope="session")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> RealRun:
    workdir = tmp_path_factory.mktemp("ui-real-run")
    result = subprocess.run(
        [sys.executable, "-m", "scaletrain", "run", "--workdir", str(workdir), "--json", *RUN],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    return RealRun(f"sqlite:///{workdir / 'telemetry.db'}", summary["run_id"], summary)


@pytest.fixture
def empty_db(tmp_path: Path) -> str:
    """A migrated database without runs."""
    url = f"sqlite:///{tmp_path / 'telemetry.db'}"
    engine = connect(url)
    migrate(engine)
    engine.dispose()
    return url


@pytest.fixture(autouse=True)
def fresh_app_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No URL from the environment, and no engine or figure cached by an earlier test."""
    monkeypatch.delenv(DB_ENV, raising=False)
    yield
    st.cache_resource.clear()
    st.cache_data.clear()
