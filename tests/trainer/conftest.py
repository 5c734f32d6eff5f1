"""Fixtures of the trainer tests that save to a real ckptd."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from ckptd.config import CkptdConfig
from ckptd.server import RunningCkptd, start


@pytest.fixture
def ckptd(tmp_path: Path) -> Iterator[RunningCkptd]:
    """A ckptd on loopback and a one-rank process group, as the trainer runs with one rank."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    server = start(CkptdConfig(data_dir=tmp_path / "ckptd", listen="127.0.0.1:0"))
    try:
        yield server
    finally:
        server.stop(grace=1)
        dist.destroy_process_group()
