"""Fixtures of the security tests: services with tokens on, a development CA."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from security_testing import Services, running_services

from scaletrain.security import TlsFiles, generate_certs


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    with running_services(tmp_path) as running:
        yield running


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return generate_certs(tmp_path_factory.mktemp("tls"))
