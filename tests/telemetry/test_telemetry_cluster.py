"""A simulated cluster of 512 ranks on 64 nodes reporting through the real client and service on
SQLite and PostgreSQL: every record stored, every step rolled up as it completed (and the rollups
equal to the same aggregates computed from the raw rows), the stragglers flagged by rank and
host, and the slow node reported as one node.

One simulation per database (module-scoped: 12 steps x 512 ranks from 2 reporter processes).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import Engine, select

from telemetry import queries
from telemetry.config import TelemetryConfig
from telemetry.health import run_health
from telemetry.models import ROLLUP_METRICS, RankStep, StepRollup
from telemetry.rollup import ROLLUP_SLOWEST
from telemetry.server import RunningTelemetry, start
from telemetry.simulated_cluster import Cluster, Result, simulate
from telemetry.views.nodes import find_ranks, node_steps, ranks_of_node, slowest_now

CLUSTER = Cluster("cluster-512", ranks=512, steps=12)


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
)
def simulated(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunningTelemetry, Result]]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('cluster') / 'telemetry.db'}"
    else:
        url = request.getfixturevalue("pg_module_schema_url")
    service = start(TelemetryConfig(db_url=url))
    try:
        yield service, simulate(service.address, CLUSTER, processes=2)
    finally:
        service.stop(grace=0)


@pytest.fixture(scope="module")
def engine(simulated: tuple[RunningTelemetry, Result]) -> Engine:
    return simulated[0].engine


def test_every_record_of_512_ranks_arrives_and_every_step_is_rolled_up_as_it_completes(
    simulated: tuple[RunningTelemetry, Result], engine: Engine
) -> None:
    _, result = simulated
    assert (result.records, result.dropped, result.rejected, result.problems) == (
        512 * 12,
        0,
        0,
        [],
    )
    with engine.connect() as connection:
        stored = connection.execute(select(RankStep.step)).all()
        rollups = connection.execute(select(StepRollup.step, StepRollup.ranks)).all()
    assert len(stored) == 512 * 12
    assert sorted(rollups) == [(step, 512) for step in range(1, 13)]
    nodes, total = node_steps(engine, CLUSTER.run_id, max_nodes=10)
    assert total == 64 and nodes["node"].nunique() == 10


def test_the_rollups_equal_the_same_aggregates_computed_from_the_raw_rows(engine: Engine) -> None:
    raw = pd.read_sql(select(RankStep).where(RankStep.run_id == CLUSTER.run_id), engine)
    rollups = pd.read_sql(select(StepRollup), engine).set_index("step").sort_index()
    for metric, column in ROLLUP_METRICS:
        by_step = raw.groupby("step")[column]
        expected = {
            "min": by_step.min(),
            "median": by_step.median(),
            "p99": by_step.quantile(0.99),
            "max": by_step.max(),
        }
        for statistic, values in expected.items():
            np.testing.assert_allclose(
                rollups[f"{metric}_{statistic}"], values.sort_index(), rtol=1e-12, err_msg=metric
            )
    np.testing.assert_allclose(rollups["loss_mean"], raw.groupby("step")["loss"].mean())
    assert list(rollups["tokens"]) == list(raw.groupby("step")["tokens"].sum())
    for step, slowest in rollups["slowest"].items():
        of_step = raw[raw["step"] == step].nlargest(ROLLUP_SLOWEST, "compute_s")
        assert [rank for rank, _, _ in slowest] == list(of_step["rank"])
        assert [node for _, node, _ in slowest] == [CLUSTER.host(r) for r in of_step["rank"]]


def test_the_stragglers_are_named_with_their_hosts_and_the_slow_node_is_one_finding(
    engine: Engine,
) -> None:
    flagged = queries.events(engine, CLUSTER.run_id, kinds=["straggler"])
    ranks = sorted(flagged[flagged["rank"] >= 0]["rank"])
    assert ranks == list(CLUSTER.fault_plan.stragglers)
    for rank in ranks:
        (message,) = flagged[flagged["rank"] == rank]["message"]
        assert f"rank {rank} on {CLUSTER.host(rank)} computes 1.6x slower" in message
    (node_event,) = flagged[flagged["rank"] < 0].itertuples()
    slow = CLUSTER.slow_node_ranks()
    assert node_event.attributes["node"] == CLUSTER.host(slow[0])
    assert f"(8 ranks: {slow[0]}-{slow[-1]})" in node_event.message
    health = run_health(engine, CLUSTER.run_id)
    assert health.straggler_ranks == ranks
    assert health.slow_nodes == [CLUSTER.host(slow[0])]
    assert health.event_counts["sdc"] == 1 and health.event_counts["loss_spike"] == 2
    # The nodes x steps view puts the slow node and the stragglers' nodes on top.
    now_ranks, now_nodes = slowest_now(engine, CLUSTER.run_id, k=3)
    assert set(now_nodes["node"]) == {CLUSTER.host(r) for r in [*ranks, slow[0]]}
    assert set(now_ranks["rank"][:2]) == set(ranks)


def test_a_search_finds_a_rank_by_number_and_the_ranks_of_a_host(engine: Engine) -> None:
    assert find_ranks(engine, CLUSTER.run_id, "300").values.tolist() == [[300, CLUSTER.host(300)]]
    host = CLUSTER.host(300)
    assert list(find_ranks(engine, CLUSTER.run_id, host)["rank"]) == list(range(296, 304))
    assert ranks_of_node(engine, CLUSTER.run_id, host) == list(range(296, 304))
    assert find_ranks(engine, CLUSTER.run_id, "512").empty
    assert find_ranks(engine, CLUSTER.run_id, "no-such-host").empty
