"""Run health end to end on SQLite and PostgreSQL: real torchrun ranks (gloo), a real telemetry
service on loopback, the real database.

Two 4-rank jobs per database, same model and data, laid out as HSDP (2 replicas x 2 shards, so the
replica checksums are live too):
  - injected: a flipped gradient bit on rank 2 at step 9, a parameter flipped in memory on rank 1
    after step 10, rank 3 a straggler from the start, a bad batch at step 13;
  - clean: no fault, and its telemetry service is stopped for a while mid-run.
The clean run is the reference: the injected run's losses must equal it until the bad batch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, select

from telemetry import queries
from telemetry.config import TelemetryConfig
from telemetry.db import connect
from telemetry.health import run_health
from telemetry.models import RankStep
from telemetry.server import RunningTelemetry, start
from telemetry.views.nodes import slowest_over_run
from telemetry.views.run import loss_points

RANKS, STEPS = 4, 14
SDC_GRAD_STEP, SDC_GRAD_RANK = 9, 2
SDC_PARAM_STEP, SDC_PARAM_RANK = 10, 1
STRAGGLER = 3
SPIKE_STEP = 13
TRAINER = [
    "--steps", str(STEPS), "--ckpt-every", "0", "--log-every", "1", "--dp-replicate", "2",
    "--dim", "64", "--n-layers", "2", "--seq-len", "64", "--global-batch", "8",
]  # fmt: skip
FAULTS = [
    "--inject-sdc", f"step={SDC_GRAD_STEP},rank={SDC_GRAD_RANK}",
    "--inject-sdc", f"step={SDC_PARAM_STEP},rank={SDC_PARAM_RANK},target=param",
    "--inject-straggler", f"rank={STRAGGLER},delay=0.15",
    "--inject-loss-spike", f"step={SPIKE_STEP}",
]  # fmt: skip
# The clean run's telemetry goes down once this step is logged and comes back at the second.
OUTAGE = (3, 8)


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """A database URL of its own for this module's jobs, on each backend."""
    if request.param == "sqlite":
        with tempfile.TemporaryDirectory(prefix="health-e2e-") as tmp:
            yield f"sqlite:///{Path(tmp) / 'telemetry.db'}"
        return
    yield request.getfixturevalue("pg_module_schema_url")


def trainer(run_id: str, address: str, *args: str) -> subprocess.Popen[str]:
    """The training job under torchrun, its output (both streams) readable line by line."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(RANKS), "-m", "trainer",
        "--run-id", run_id, "--telemetry", address, *TRAINER, *args,
    ]  # fmt: skip
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )


def finish(process: subprocess.Popen[str], log: list[str]) -> None:
    assert process.stdout is not None
    log.extend(process.stdout)
    assert process.wait(timeout=600) == 0, "".join(log[-40:])


@pytest.fixture(scope="module")
def injected(backend: str) -> str:
    """Runs the injected job; returns its run id."""
    service = start(TelemetryConfig(db_url=backend))
    try:
        log: list[str] = []
        finish(trainer("injected", service.address, *FAULTS), log)
    finally:
        service.stop(grace=5)
    return "injected"


@pytest.fixture(scope="module")
def clean(backend: str) -> tuple[str, int]:
    """Runs the clean job with a telemetry outage; returns its run id and how many records the
    database held while the service was down."""
    service: RunningTelemetry | None = start(TelemetryConfig(db_url=backend))
    port = service.port
    process = trainer("clean", service.address)
    log: list[str] = []
    held_during_outage = -1
    try:
        assert process.stdout is not None
        for line in process.stdout:
            log.append(line)
            if service is not None and line.startswith(f"[trainer] step {OUTAGE[0]} "):
                service.stop(grace=0)
                service = None
                held_during_outage = records(backend, "clean")
            elif service is None and line.startswith(f"[trainer] step {OUTAGE[1]} "):
                service = start(TelemetryConfig(db_url=backend, listen=f"127.0.0.1:{port}"))
        finish(process, log)
    finally:
        if process.poll() is None:
            process.kill()
        if service is not None:
            service.stop(grace=5)
    return "clean", held_during_outage


def records(url: str, run_id: str) -> int:
    engine = connect(url, read_only=True)
    try:
        with engine.connect() as connection:
            statement = select(func.count()).where(RankStep.run_id == run_id)
            return connection.execute(statement).scalar_one()
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def engine(backend: str) -> Iterator[Engine]:
    engine = connect(backend, read_only=True)
    yield engine
    engine.dispose()


def losses(engine: Engine, run_id: str) -> list[float]:
    return loss_points(engine, run_id)["loss"].tolist()


def test_an_injected_gradient_flip_is_caught_at_its_step_on_its_rank_and_replayed(
    injected: str, engine: Engine
) -> None:
    sdc = queries.events(engine, injected, kinds=["sdc"]).sort_values("step")
    rows = [
        (step, rank, attributes["stage"])
        for step, rank, attributes in zip(sdc["step"], sdc["rank"], sdc["attributes"], strict=True)
    ]
    assert rows == [
        (SDC_GRAD_STEP, SDC_GRAD_RANK, "gradients"),
        (SDC_PARAM_STEP, SDC_PARAM_RANK, "at_rest"),
    ]
    replays = queries.events(engine, injected, kinds=["replay"])
    assert sorted(replays["step"]) == [SDC_GRAD_STEP, SPIKE_STEP]


def test_after_the_corruptions_are_undone_the_losses_equal_the_clean_runs(
    injected: str, clean: tuple[str, int], engine: Engine
) -> None:
    reference = losses(engine, clean[0])
    assert len(reference) == STEPS
    assert losses(engine, injected)[: SPIKE_STEP - 1] == reference[: SPIKE_STEP - 1]


def test_a_bad_batch_is_classified_as_data_not_as_corruption(injected: str, engine: Engine) -> None:
    spikes = queries.events(engine, injected, kinds=["loss_spike"])
    at_spike = spikes[spikes["step"] == SPIKE_STEP]
    assert [a["verdict"] for a in at_spike["attributes"]] == ["data"]
    assert SPIKE_STEP not in set(queries.events(engine, injected, kinds=["sdc"])["step"])


def test_the_straggler_is_flagged_within_five_steps_and_no_other_rank(
    injected: str, engine: Engine
) -> None:
    flagged = queries.events(engine, injected, kinds=["straggler"])
    assert set(flagged["rank"]) == {STRAGGLER}
    assert flagged["step"].min() <= 5
    # The step rollups name it the slowest rank of the run.
    ranks, _, _ = slowest_over_run(engine, injected, k=1)
    assert list(ranks["rank"]) == [STRAGGLER]


def test_a_clean_run_whose_telemetry_went_down_flags_nothing_and_all_its_records_arrive(
    clean: tuple[str, int], backend: str, engine: Engine
) -> None:
    run_id, held_during_outage = clean
    assert 0 <= held_during_outage < STEPS * RANKS
    assert records(backend, run_id) == STEPS * RANKS
    health = run_health(engine, run_id)
    assert health.status == "finished"
    assert health.findings == []
    assert health.dropped_records == 0
    assert health.mfu.peak_flops_source.startswith("calibrated: 512x512 fp32 GEMM")
    assert 0 < health.mfu.mfu < 1
    assert 0 < health.goodput.goodput < 1
