"""Fixtures of the telemetry tests: a migrated database on SQLite and on PostgreSQL.

PostgreSQL comes from the shared fixtures in tests/conftest.py (SCALETRAIN_TEST_PG_URL, skipped
with the reason when unset); each test gets a schema of its own, dropped afterwards, so reruns and
parallel sessions never see each other's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from scaletrain.v1 import common_pb2, telemetry_pb2
from telemetry.db import connect, migrate
from telemetry.store import TelemetryStore


@pytest.fixture(
    params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)],
)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'telemetry.db'}"
    return request.getfixturevalue("pg_schema_url")


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    engine = connect(db_url)
    migrate(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def store(engine: Engine) -> TelemetryStore:
    return TelemetryStore(engine)


RegisterRun = Callable[..., telemetry_pb2.RegisterRunRequest]


@pytest.fixture
def run_request() -> RegisterRun:
    """Builds the RegisterRunRequest of a run of `world_size` ranks laid out as pure FSDP."""

    def build(
        run_id: str = "run-1", world_size: int = 4, **fields: object
    ) -> telemetry_pb2.RegisterRunRequest:
        return telemetry_pb2.RegisterRunRequest(
            run_id=run_id,
            name=f"{run_id} name",
            config_json='{"lr": 0.001}',
            world_size=world_size,
            layout=common_pb2.ParallelLayout(dp_shard=world_size),
            model_params=1_000_000,
            hardware="cpu",
            ranks=[
                telemetry_pb2.RankInfo(rank=rank, host=f"node{rank // 2}", device="cpu")
                for rank in range(world_size)
            ],
            **fields,
        )

    return build
