"""The names every service shares (`scaletrain.names`): one tier table, one run-id rule."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptd.config import CkptdConfig
from ckptd.store import CheckpointStore
from scaletrain.errors import InvalidArgument
from scaletrain.names import RUN_ID_RULE, TIER_LABELS, TIER_NAMES, check_run_id
from scaletrain.v1 import checkpoint_pb2, common_pb2, telemetry_pb2
from telemetry.db import connect, migrate
from telemetry.store import TelemetryStore
from trainer.__main__ import main as trainer_main

# Each one refused by some service before the rule was shared: a space or a slash (ckptd only), a
# leading dot or dash (ckptd only), too long for ckptd and telemetry's column, empty (all).
REFUSED = ["", "a b", "../etc", "run/1", ".hidden", "-flag", "naïve", "x" * 129]


def test_every_tier_of_the_contract_has_one_name_in_one_casing() -> None:
    tiers = [v for v in common_pb2.Tier.values() if v != common_pb2.TIER_UNSPECIFIED]
    assert list(TIER_LABELS) == tiers
    assert TIER_LABELS == {
        common_pb2.TIER_MEMORY: "memory",
        common_pb2.TIER_SSD: "SSD",
        common_pb2.TIER_S3: "S3",
    }
    assert {tier: label.lower() for tier, label in TIER_LABELS.items()} == TIER_NAMES


@pytest.fixture
def ckptd_store(tmp_path: Path) -> Iterator[CheckpointStore]:
    store = CheckpointStore(CkptdConfig(data_dir=tmp_path / "ckptd"))
    yield store
    store.close(timeout_s=1)


@pytest.fixture
def telemetry_store(tmp_path: Path) -> Iterator[TelemetryStore]:
    engine = connect(f"sqlite:///{tmp_path / 'telemetry.db'}")
    migrate(engine)
    yield TelemetryStore(engine)
    engine.dispose()


def _registration(run_id: str) -> telemetry_pb2.RegisterRunRequest:
    return telemetry_pb2.RegisterRunRequest(
        run_id=run_id, world_size=1, ranks=[telemetry_pb2.RankInfo(rank=0)]
    )


@pytest.mark.parametrize("run_id", REFUSED, ids=lambda r: repr(r[:12]))
def test_a_run_id_a_service_would_refuse_is_refused_at_the_trainers_start_in_the_same_words(
    run_id: str,
    ckptd_store: CheckpointStore,
    telemetry_store: TelemetryStore,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(InvalidArgument) as ckptd:
        ckptd_store.saves.open_save(checkpoint_pb2.CheckpointRef(run=run_id, step=10), 1)
    with pytest.raises(InvalidArgument) as telemetry:
        telemetry_store.register_run(_registration(run_id))

    assert trainer_main([f"--run-id={run_id}"]) == 2  # refused before torchrun is needed
    trainer = capsys.readouterr().err.strip()

    # Each names the field as its interface does, then says the same thing.
    said = str(ckptd.value).removeprefix("run name ")
    assert str(telemetry.value) == f"run_id {said}"
    assert trainer == f"trainer: error: --run-id (run_id) {said}"
    assert said == "is empty" if not run_id else said.endswith(f"is invalid: use {RUN_ID_RULE}")


def test_a_run_id_one_service_accepts_every_service_accepts(
    ckptd_store: CheckpointStore,
    telemetry_store: TelemetryStore,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_id = "run-20261202-100000-ab12:exp.1+lr=3e-4@node0_" + "x" * 83
    assert check_run_id(run_id) == run_id and len(run_id) == 128
    assert telemetry_store.register_run(_registration(run_id)).created
    save_id = ckptd_store.saves.open_save(checkpoint_pb2.CheckpointRef(run=run_id, step=10), 1)
    ckptd_store.saves.abort(save_id, "test")
    # Past the run id, the trainer refuses only the bad step count.
    assert trainer_main([f"--run-id={run_id}", "--steps=0"]) == 2
    assert capsys.readouterr().err.startswith("trainer: error: --steps (schedule.steps)")
