"""Authentication and authorization of ckptd and telemetry over real gRPC on loopback.

Tokens on: a call without a token, with an unknown one, with another run's token or with a
read-only token that writes or deletes is refused before the service acts, and nothing stored
changes; each token can still do what its grant allows.
"""

from __future__ import annotations

import time

import grpc
import pytest
from security_testing import SHARD, Services, code_of, save_checkpoint, step_record

from ckptd.catalog import OPEN
from scaletrain.errors import PermissionDenied, Unauthenticated
from scaletrain.security import ClientSecurity, Role, add_token
from scaletrain.transport import make_channel, wait_until_healthy
from scaletrain.v1 import checkpoint_pb2, checkpoint_pb2_grpc, telemetry_pb2

DENIED = grpc.StatusCode.PERMISSION_DENIED
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture
def stored(services: Services) -> Services:
    """alpha@1 committed, an open save of alpha@2 with one file, alpha's run and a step."""
    with services.ckptd_client(services.tokens.alpha) as alpha:
        save_checkpoint(alpha, "alpha", 1)
        save_id = alpha.open_save("alpha", 2, 1).save_id
        alpha.write_file(save_id, "__0_0.distcp", 0, SHARD, b"x" * 1000)
    # The file reaches the save's staging directory in the background: let it settle.
    incoming = services.ckptd.store.config.data_dir / "ssd" / ".incoming"
    for _ in range(100):
        if not any(incoming.iterdir()):
            break
        time.sleep(0.05)
    with services.telemetry_stub(services.tokens.alpha) as stub:
        stub.RegisterRun(telemetry_pb2.RegisterRunRequest(run_id="alpha", world_size=1))
        stub.ReportSteps(iter([telemetry_pb2.StepBatch(records=[step_record("alpha", 1)])]))
    return services


def _every_write(services: Services, token: str | None) -> dict[str, grpc.StatusCode]:
    """Try every writing call on alpha's data with `token`; the status code of each."""
    (save_id,) = [c.save_id for c in services.ckptd.store.catalog.saves_in(OPEN)]
    with make_channel(services.ckptd.address, ClientSecurity(token=token)) as channel:
        ckpt = checkpoint_pb2_grpc.CheckpointServiceStub(channel)
        ref = checkpoint_pb2.CheckpointRef(run="alpha", step=3)
        header = checkpoint_pb2.FileHeader(save_id=save_id, path="__0_1.distcp", kind=SHARD)
        codes = {
            "OpenSave": code_of(
                lambda: ckpt.OpenSave(checkpoint_pb2.OpenSaveRequest(ref=ref, world_size=1))
            ),
            "WriteFile": code_of(
                lambda: ckpt.WriteFile(iter([checkpoint_pb2.WriteFileRequest(header=header)]))
            ),
            "CommitSave": code_of(
                lambda: ckpt.CommitSave(checkpoint_pb2.CommitSaveRequest(save_id=save_id))
            ),
            "AbortSave": code_of(
                lambda: ckpt.AbortSave(checkpoint_pb2.AbortSaveRequest(save_id=save_id))
            ),
            "DeleteCheckpoint": code_of(
                lambda: ckpt.DeleteCheckpoint(
                    checkpoint_pb2.DeleteCheckpointRequest(
                        ref=checkpoint_pb2.CheckpointRef(run="alpha", step=1)
                    )
                )
            ),
            "SetReplicaRate": code_of(
                lambda: ckpt.SetReplicaRate(checkpoint_pb2.SetReplicaRateRequest(bytes_per_s=1))
            ),
        }
    with services.telemetry_stub(token) as stub:
        batch = telemetry_pb2.StepBatch(records=[step_record("alpha", 2)])
        columns = telemetry_pb2.StepBatch(columns=telemetry_pb2.StepColumns(run_id=["alpha"]))
        event = telemetry_pb2.Event(run_id="alpha", kind=telemetry_pb2.EVENT_KIND_ALERT)
        codes |= {
            "RegisterRun": code_of(
                lambda: stub.RegisterRun(telemetry_pb2.RegisterRunRequest(run_id="alpha"))
            ),
            "ReportSteps": code_of(lambda: stub.ReportSteps(iter([batch]))),
            "ReportSteps(columns)": code_of(lambda: stub.ReportSteps(iter([columns]))),
            "ReportEvents": code_of(
                lambda: stub.ReportEvents(telemetry_pb2.EventBatch(events=[event]))
            ),
        }
    return codes


def test_every_call_without_a_token_is_refused_unauthenticated_and_nothing_changes(
    stored: Services,
):
    before = stored.snapshot()
    codes = _every_write(stored, None)
    assert set(codes.values()) == {UNAUTHENTICATED}, codes
    with stored.ckptd_client(None) as anonymous, pytest.raises(Unauthenticated, match="no token"):
        anonymous.list()
    assert stored.snapshot() == before


def test_an_unknown_token_is_refused_unauthenticated_and_nothing_changes(stored: Services):
    before = stored.snapshot()
    codes = _every_write(stored, "not-a-token-of-this-service")
    assert set(codes.values()) == {UNAUTHENTICATED}, codes
    assert stored.snapshot() == before


def test_another_runs_trainer_token_may_neither_write_nor_read_nor_delete_this_run(
    stored: Services,
):
    before = stored.snapshot()
    codes = _every_write(stored, stored.tokens.beta)
    assert set(codes.values()) == {DENIED}, codes
    with stored.ckptd_client(stored.tokens.beta) as beta:
        for read in (lambda: beta.get("alpha"), lambda: beta.read("alpha", 1, "__0_0.distcp")):
            with pytest.raises(PermissionDenied, match="trainer token of 'beta'"):
                read()
        with pytest.raises(PermissionDenied):
            beta.list()  # every run: only for grants over every run
    with stored.telemetry_stub(stored.tokens.beta) as stub:
        request = telemetry_pb2.GetResumePointRequest(run_id="alpha")
        assert code_of(lambda: stub.GetResumePoint(request)) == DENIED
    assert stored.snapshot() == before


def test_a_read_only_token_reads_everything_but_cannot_write_or_delete(stored: Services):
    before = stored.snapshot()
    codes = _every_write(stored, stored.tokens.reader)
    assert set(codes.values()) == {DENIED}, codes
    assert stored.snapshot() == before
    with stored.ckptd_client(stored.tokens.reader) as reader:
        assert [c.ref.run for c in reader.list()] == ["alpha"]
        assert reader.get("alpha").ref.step == 1
        assert len(reader.read("alpha", 1, "__0_0.distcp")) == 70_000


def test_a_trainer_saves_and_restores_its_own_run_but_only_an_admin_deletes(stored: Services):
    with stored.ckptd_client(stored.tokens.alpha) as alpha:
        shard = save_checkpoint(alpha, "alpha", 5)
        assert alpha.read("alpha", 5, "__0_0.distcp") == shard
        with pytest.raises(PermissionDenied, match="may not admin-access"):
            alpha.delete("alpha", 5)
        with pytest.raises(PermissionDenied, match="may not admin-access"):
            alpha.set_replica_rate(0)
    with stored.ckptd_client(stored.tokens.admin) as admin:
        admin.delete("alpha", 5)
        assert [c.ref.step for c in admin.list("alpha")] == [1]


def test_the_health_service_answers_without_a_token(services: Services):
    wait_until_healthy(services.ckptd.address, timeout_s=5, security=ClientSecurity())
    wait_until_healthy(services.telemetry.address, timeout_s=5, security=ClientSecurity())


def test_a_token_added_to_the_file_while_the_service_runs_is_accepted(services: Services):
    gamma = add_token(services.tokens.path, Role.TRAINER, "gamma")
    with services.ckptd_client(gamma) as client:
        for _ in range(40):  # the file is re-read at most once a second
            try:
                save_checkpoint(client, "gamma", 1)
                break
            except Unauthenticated:
                time.sleep(0.1)
        assert client.get("gamma").ref.step == 1


def test_the_tokens_file_holds_only_hashes(services: Services):
    text = services.tokens.path.read_text()
    for token in (services.tokens.alpha, services.tokens.reader, services.tokens.admin):
        assert token not in text
    assert services.tokens.path.stat().st_mode & 0o077 == 0
