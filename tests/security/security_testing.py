"""Helpers of the security tests: real ckptd and telemetry services with tokens, and snapshots of
everything they store, to show that what a refused or hostile call touched did not change.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from sqlalchemy import text

from ckptd.client import CkptdClient
from ckptd.config import CkptdConfig
from ckptd.server import RunningCkptd
from ckptd.server import start as start_ckptd
from scaletrain.security import (
    ALL_RUNS,
    ClientSecurity,
    Role,
    ServerSecurity,
    TlsFiles,
    TokenTable,
    add_token,
)
from scaletrain.transport import make_channel
from scaletrain.v1 import checkpoint_pb2, telemetry_pb2, telemetry_pb2_grpc
from telemetry.config import TelemetryConfig
from telemetry.server import RunningTelemetry
from telemetry.server import start as start_telemetry

SHARD = checkpoint_pb2.FILE_KIND_SHARD
METADATA = checkpoint_pb2.FILE_KIND_METADATA


@dataclass(frozen=True)
class Tokens:
    """One token of each kind the tests need, minted into a tokens file."""

    alpha: str  # trainer of run "alpha"
    beta: str  # trainer of run "beta"
    reader: str  # reads every run
    admin: str  # everything, deletes too
    path: Path

    @classmethod
    def mint(cls, path: Path) -> Tokens:
        return cls(
            alpha=add_token(path, Role.TRAINER, "alpha", "trainer of alpha"),
            beta=add_token(path, Role.TRAINER, "beta", "trainer of beta"),
            reader=add_token(path, Role.READER, ALL_RUNS, "ui"),
            admin=add_token(path, Role.ADMIN, ALL_RUNS, "operator"),
            path=path,
        )


def as_client(token: str | None, tls: TlsFiles | None = None) -> ClientSecurity:
    return ClientSecurity(tls=tls, token=token)


@dataclass
class Services:
    ckptd: RunningCkptd
    telemetry: RunningTelemetry
    tokens: Tokens
    tls: TlsFiles | None = None
    # Trainer tokens of the runs `running_services` was asked for: run -> token.
    trainers: dict[str, str] = field(default_factory=dict)

    def ckptd_client(self, token: str | None) -> CkptdClient:
        return CkptdClient(self.ckptd.address, as_client(token, self.tls))

    @contextlib.contextmanager
    def telemetry_stub(
        self, token: str | None
    ) -> Iterator[telemetry_pb2_grpc.TelemetryServiceStub]:
        with make_channel(self.telemetry.address, as_client(token, self.tls)) as channel:
            yield telemetry_pb2_grpc.TelemetryServiceStub(channel)

    def snapshot(self) -> tuple:
        """Everything both services store: every checkpoint (committed or not) with its files'
        hashes, each file's bytes on the SSD tier, and every telemetry row."""
        infos = tuple(
            info.SerializeToString(deterministic=True)
            for info in self.ckptd.store.member.checkpoints("", include_uncommitted=True)
        )
        ssd = self.ckptd.store.config.data_dir / "ssd"
        files = tuple(
            sorted(
                (str(p.relative_to(ssd)), hashlib.sha256(p.read_bytes()).hexdigest())
                for p in ssd.rglob("*")
                if p.is_file()
            )
        )
        rows = []
        with self.telemetry.engine.connect() as db:
            for table in ("runs", "ranks", "rank_steps", "checkpoints", "events"):
                rows.append(
                    tuple(map(tuple, db.execute(text(f"SELECT * FROM {table} ORDER BY 1"))))
                )
        return infos, files, tuple(rows)


@contextlib.contextmanager
def running_services(
    tmp_path: Path,
    tls: TlsFiles | None = None,
    client_auth: bool = False,
    trainers_of: tuple[str, ...] = (),
    **ckptd_options: object,
) -> Iterator[Services]:
    """ckptd (no S3: its tier is ckptd's own business) and telemetry, tokens on, over loopback;
    with a trainer token for each run of `trainers_of` besides the `Tokens`."""
    tokens = Tokens.mint(tmp_path / "tokens.json")
    trainers = {run: add_token(tokens.path, Role.TRAINER, run) for run in trainers_of}
    security = ServerSecurity(tls=tls, client_auth=client_auth, tokens=TokenTable(tokens.path))
    telemetry = start_telemetry(
        TelemetryConfig(db_url=f"sqlite:///{tmp_path / 'telemetry.db'}", security=security)
    )
    try:
        config = CkptdConfig(
            data_dir=tmp_path / "ckptd",
            memory_budget_bytes=64 << 20,
            security=security,
            **ckptd_options,  # type: ignore[arg-type]
        )
        ckptd = start_ckptd(config)
        try:
            yield Services(ckptd, telemetry, tokens, tls, trainers)
        finally:
            ckptd.stop(0)
    finally:
        telemetry.stop(0)


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def save_checkpoint(client: CkptdClient, run: str, step: int, size: int = 70_000) -> bytes:
    """Save a one-rank checkpoint (a shard and the metadata) and return the shard's bytes."""
    shard = payload(size, step)
    save_id = client.open_save(run, step, 1).save_id
    client.write_file(save_id, "__0_0.distcp", 0, SHARD, shard)
    client.write_file(save_id, ".metadata", 0, METADATA, b"meta" * 10)
    client.commit(save_id)
    return shard


def step_record(run: str, step: int, rank: int = 0) -> telemetry_pb2.RankStep:
    return telemetry_pb2.RankStep(run_id=run, step=step, rank=rank, loss=1.0 / step, tokens=64)


def code_of(call: object) -> grpc.StatusCode:
    """The status code a call (a zero-argument function) ended with; OK if it returned."""
    try:
        result = call()  # type: ignore[operator]
        if hasattr(result, "__next__"):
            list(result)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK
