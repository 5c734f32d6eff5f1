"""Fixtures of the ckptd tests: a real SeaweedFS for the session, stores and servers on tmp dirs.

Nothing is faked: the SSD tier writes to tmp_path, the S3 tier talks to a real S3 server, and the
gRPC tests go over loopback. Each test gets its own bucket so tests never see each other's objects.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ckptd_testing import FAST_RETRIES
from cluster_testing import Cluster

from ckptd.config import CkptdConfig, S3Config
from ckptd.server import RunningCkptd, start
from ckptd.store import CheckpointStore
from scaletrain.app.seaweed import SeaweedS3


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    with SeaweedS3(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


@pytest.fixture
def s3_config(seaweed: SeaweedS3) -> S3Config:
    """A fresh bucket on the session's SeaweedFS, with fast retries."""
    config = seaweed.s3_config(bucket=f"t-{uuid.uuid4().hex[:12]}")
    return S3Config(**{**vars(config), **FAST_RETRIES})


@pytest.fixture
def dead_s3_config() -> S3Config:
    """An S3 endpoint on a port nobody listens on: every request is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return S3Config(
        endpoint_url=f"http://127.0.0.1:{port}",
        bucket="unreachable",
        access_key_id="k",
        secret_access_key="s",
        **FAST_RETRIES,
    )


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[Callable[..., CheckpointStore]]:
    """Open stores on tmp_path/ckptd (kwargs go to CkptdConfig); all are closed at teardown."""
    stores: list[CheckpointStore] = []

    def _open(**kwargs: object) -> CheckpointStore:
        kwargs.setdefault("data_dir", tmp_path / "ckptd")
        store = CheckpointStore(CkptdConfig(**kwargs))  # type: ignore[arg-type]
        stores.append(store)
        return store

    yield _open
    for store in stores:
        store.close(timeout_s=1)


@pytest.fixture
def run_ckptd(tmp_path: Path) -> Iterator[Callable[..., RunningCkptd]]:
    """Start ckptd servers on loopback (kwargs go to CkptdConfig); all are stopped at teardown."""
    servers: list[RunningCkptd] = []

    def _start(**kwargs: object) -> RunningCkptd:
        kwargs.setdefault("data_dir", tmp_path / "ckptd")
        running = start(CkptdConfig(**kwargs))  # type: ignore[arg-type]
        servers.append(running)
        return running

    yield _start
    for running in servers:
        running.stop(grace=1)


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """Start clusters of ckptd processes (`Cluster`); all are stopped at teardown."""
    made: list[Cluster] = []

    def _make(n: int, s3: S3Config | None = None, *args: str, metrics: bool = False) -> Cluster:
        cluster = Cluster(tmp_path, n, s3, args, metrics)
        made.append(cluster)
        return cluster

    yield _make
    for cluster in made:
        cluster.close()
