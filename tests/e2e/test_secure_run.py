"""`scaletrain run --secure`: the whole platform over TLS with per-run tokens, and no secret leaks.

While the run trains, every process's command line is recorded and the secrets its children hold
are taken from their environments (the trainer's and ckptd's tokens, the S3 secret key). After
it, those secrets must appear in no log, no command line, no database and no file of the work
directory except where they belong, and the tokens file must hold only hashes.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_runs import scaletrain_json

from scaletrain.security import token_hash

pytestmark = pytest.mark.e2e

SECRET_VARIABLES = (b"SCALETRAIN_TOKEN", b"AWS_SECRET_ACCESS_KEY")


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _watch(proc: subprocess.Popen, workdir: Path) -> tuple[set[bytes], set[bytes]]:
    """Until `proc` ends: every command line seen, and the secrets in the environments of the
    processes of this work directory."""
    cmdlines: set[bytes] = set()
    secrets: set[bytes] = set()
    tls_dir = f"SCALETRAIN_TLS_DIR={(workdir / 'tls').resolve()}".encode()
    while proc.poll() is None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            cmdline = _read(entry / "cmdline")
            cmdlines.add(cmdline)
            environ = _read(entry / "environ").split(b"\0")
            if tls_dir in environ or str(workdir).encode() in cmdline:
                for item in environ:
                    name, _, value = item.partition(b"=")
                    if name in SECRET_VARIABLES and value:
                        secrets.add(value)
        time.sleep(0.1)
    return cmdlines, secrets


def test_a_secure_run_trains_over_tls_and_leaks_no_secret_into_logs_command_lines_or_files(
    tmp_path: Path,
):
    workdir = tmp_path / "secure"
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "scaletrain",
                "run",
                "--secure",
                "--workdir",
                str(workdir),
                "--ranks",
                "2",
                "--steps",
                "2",
                "--ckpt-every",
                "1",
                "--log-every",
                "1",
                "--json",
            ],
            stdout=stdout,
            stderr=stderr,
        )
        cmdlines, secrets = _watch(proc, workdir)
    assert proc.wait() == 0, err.read_text()[-3000:]
    summary = json.loads(out.read_text())
    assert [c["tiers"] for c in summary["checkpoints"]] == [["memory", "ssd", "s3"]] * 2

    # ckptd's token reported every tier commit to telemetry; the trainer's token its steps.
    with sqlite3.connect(workdir / "telemetry.db") as db:
        (commits,) = db.execute(
            "SELECT count(*) FROM events WHERE kind = 'checkpoint_committed'"
        ).fetchone()
    assert commits == 6
    grants = json.loads((workdir / "tokens.json").read_text())
    assert {(g["role"], g["run"]) for g in grants} >= {
        ("trainer", summary["run_id"]), ("trainer", "*"), ("reader", summary["run_id"])
    }  # fmt: skip

    tokens = {s for s in secrets if token_hash(s.decode()) in {g["sha256"] for g in grants}}
    assert len(tokens) >= 2, "the trainer's and ckptd's tokens were not seen"
    assert len(secrets - tokens) >= 1, "the S3 secret key was not seen"
    scanned = {str(p): _read(p) for p in workdir.rglob("*") if p.is_file()}
    scanned |= {"stdout": _read(out), "stderr": _read(err)}
    assert any(name.endswith(".log") for name in scanned)
    leaks = [
        (secret[:6] + b"...", where)
        for secret in secrets
        for where, content in [*scanned.items(), *(("a command line", c) for c in cmdlines)]
        if secret in content
    ]
    assert not leaks


def test_a_secure_two_node_drill_replaces_a_lost_node_from_copies_sent_over_tls(
    tmp_path: Path,
) -> None:
    workdir = tmp_path / "drill"
    flags = "--nodes 2 --ranks 4 --steps 20 --ckpt-every 5 --spares 1 --schedule kill-node@8"
    drill = scaletrain_json("chaos", "--secure", "--workdir", str(workdir), *flags.split())
    assert drill["completed"] and not drill["checkpoints_lost"], drill["_log"][-3000:]
    (record,) = drill["fault_recoveries"]
    assert record["restarted"] and record["spare"], record
    # The lost node's part came from its peer's copy (made over the TLS data socket), in memory:
    # nothing from S3.
    sources = {source.split("@")[0] for source in record["restored_from"]}
    assert sources and "S3" not in sources, record
    # Every ckptd served the others over its data socket, with TLS: none fell back to gRPC.
    logs = "".join(_read(p).decode(errors="replace") for p in (workdir / "logs").glob("ckptd*"))
    assert logs and "no TLS with the data socket" not in logs and "through ReadFile" not in logs
    # The drill's own calls went with a token of their own (an admin of the stack).
    grants = json.loads((workdir / "tokens.json").read_text())
    assert "admin" in {g["role"] for g in grants}
