"""Secrets on the command line: certificates and tokens made by `scaletrain`, and database and S3
credentials that never show in `ps`, in logs or in error messages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.config import S3Config
from scaletrain.errors import UserError
from scaletrain.security import ClientSecurity, TlsFiles, database_url, token_hash
from scaletrain.transport import make_channel, wait_until_healthy
from telemetry.config import TelemetryConfig
from telemetry.db import connect

PASSWORD = "hunter2-pg-secret"


def scaletrain(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scaletrain", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_scaletrain_certs_writes_a_ca_and_keys_only_the_owner_can_read(tmp_path: Path):
    result = scaletrain("certs", str(tmp_path / "tls"), "--host", "ckptd.internal")
    assert result.returncode == 0, result.stderr
    assert "SCALETRAIN_TLS_DIR=" in result.stdout
    files = TlsFiles(tmp_path / "tls")
    for key in (files.server_key, files.client_key):
        assert key.stat().st_mode & 0o077 == 0
    from cryptography import x509

    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "ckptd.internal" in names.get_values_for_type(x509.DNSName)


def test_scaletrain_token_prints_the_token_once_and_keeps_only_its_hash(tmp_path: Path):
    tokens = tmp_path / "tokens.json"
    result = scaletrain("token", "--tokens", str(tokens), "--role", "trainer", "--run", "r-1")
    assert result.returncode == 0, result.stderr
    token = result.stdout.strip()
    assert len(token) >= 40 and token not in tokens.read_text()
    assert json.loads(tokens.read_text()) == [
        {"sha256": token_hash(token), "role": "trainer", "run": "r-1", "name": ""}
    ]
    bad = scaletrain("token", "--tokens", str(tokens), "--role", "trainer", "--run", "../x")
    assert bad.returncode == 1 and "run name '../x' is invalid" in bad.stderr


def test_a_database_password_on_the_command_line_is_refused_without_echoing_it():
    result = scaletrain("telemetry", "--db", f"postgresql://postgres:{PASSWORD}@127.0.0.1/test")
    assert result.returncode == 1
    assert "--db must not carry a password" in result.stderr
    assert PASSWORD not in result.stderr + result.stdout


def test_the_database_password_comes_from_the_environment_or_a_file(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("SCALETRAIN_DB_URL", raising=False)
    (tmp_path / "pw").write_text(PASSWORD + "\n")
    monkeypatch.setenv("SCALETRAIN_DB_PASSWORD_FILE", str(tmp_path / "pw"))
    url = database_url("postgresql+psycopg://postgres@db:5432/runs", default="sqlite:///x.db")
    assert url == f"postgresql+psycopg://postgres:{PASSWORD}@db:5432/runs"
    assert PASSWORD not in repr(TelemetryConfig(db_url=url))
    monkeypatch.setenv("SCALETRAIN_DB_PASSWORD_FILE", str(tmp_path / "missing"))
    with pytest.raises(UserError, match="cannot read SCALETRAIN_DB_PASSWORD_FILE"):
        database_url(None, default="sqlite:///x.db")


def test_a_bad_database_url_is_reported_without_its_password():
    with pytest.raises(UserError) as refused:
        connect(f"postgresql+nonsense://postgres:{PASSWORD}@h:notaport/db")
    assert PASSWORD not in str(refused.value)


def test_s3_credentials_come_from_files_and_never_show_in_the_config(tmp_path, monkeypatch):
    (tmp_path / "secret").write_text("s3-secret-key-value")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY_FILE", str(tmp_path / "secret"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key-id")
    config = S3Config.from_env("http://127.0.0.1:1")
    assert config.secret_access_key == "s3-secret-key-value"
    assert "s3-secret-key-value" not in repr(config)


@pytest.mark.postgres
def test_telemetry_takes_its_database_password_from_a_file_and_shows_it_nowhere(
    pg_url: str, tmp_path: Path
):
    """PostgreSQL here trusts loopback, so any password connects: what matters is where it goes."""
    (tmp_path / "pw").write_text(PASSWORD)
    process = subprocess.Popen(
        [sys.executable, "-m", "scaletrain", "telemetry", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "SCALETRAIN_DB_URL": pg_url,
            "SCALETRAIN_DB_PASSWORD_FILE": str(tmp_path / "pw"),
        },
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("telemetry listening on"), line
        wait_until_healthy(line.split()[-1], timeout_s=10, security=ClientSecurity())
        with make_channel(line.split()[-1], ClientSecurity()):
            pass
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode()
        assert PASSWORD not in cmdline
    finally:
        process.terminate()
        output = process.communicate(timeout=15)[0]
    assert PASSWORD not in line + output
