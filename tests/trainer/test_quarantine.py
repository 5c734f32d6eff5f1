"""Quarantine: a rank the corruption checks name `after` times is reported once, with its machine
and the steps, and under --quarantine cordon its machine's agent is told to cordon it at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaletrain.cordon import FAILURES_ENV, QUARANTINE_LINE, QUARANTINED
from trainer.health.quarantine import Quarantine

HOSTS = ["node0", "node0", "node1", "node1"]


def _quarantine(policy: str, rank: int, events: list) -> Quarantine:
    return Quarantine(policy, 2, HOSTS, rank, lambda *event: events.append(event))


def test_the_second_finding_on_a_rank_quarantines_it_once_and_rank_0_reports_it(capsys) -> None:
    events: list = []
    quarantine = _quarantine("alert", 0, events)
    quarantine.named(12, [2])
    quarantine.named(13, [1])
    assert events == [] and quarantine.quarantined == set()
    quarantine.named(14, [2])
    quarantine.named(20, [2])  # already quarantined: not again
    assert quarantine.quarantined == {2}
    ((kind, step, rank, message, attributes),) = events
    assert (kind, step, rank) == ("quarantine", 14, 2)
    assert attributes == {"node": "node1", "steps": "12,14", "policy": "alert"}
    assert "rank 2 (node1)" in message and "steps 12, 14" in message
    (line,) = capsys.readouterr().out.splitlines()
    found = QUARANTINE_LINE.match(line)
    assert found is not None and found.groups() == ("2", "node1", "alert"), line


def test_under_cordon_the_named_rank_tells_its_machines_agent(tmp_path: Path, monkeypatch) -> None:
    failures = tmp_path / "failures"
    monkeypatch.setenv(FAILURES_ENV, str(failures))
    for rank in range(4):  # every rank counts; only the named one records the failure
        quarantine = _quarantine("cordon", rank, [])
        quarantine.named(5, [3])
        quarantine.named(9, [3, 1])
    (record,) = [json.loads(line) for line in failures.read_text().splitlines()]
    assert (record["rank"], record["step"]) == (3, 9)
    assert record["cause"].startswith(QUARANTINED) and "steps 5, 9" in record["cause"]


@pytest.mark.parametrize("policy", ["alert", "off"])
def test_only_cordon_takes_the_machine_out(tmp_path: Path, monkeypatch, policy: str) -> None:
    failures = tmp_path / "failures"
    monkeypatch.setenv(FAILURES_ENV, str(failures))
    events: list = []
    quarantine = _quarantine(policy, 3, events)
    quarantine.named(5, [3])
    quarantine.named(9, [3])
    assert not failures.exists()
    assert quarantine.quarantined == ({3} if policy == "alert" else set())
