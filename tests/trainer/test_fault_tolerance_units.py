"""The pieces of fault tolerance that need no job: the watchdog, the health check before start,
the chaos schedule and the restart budget's option."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from scaletrain.app.chaos import (
    DEFAULT_SCHEDULE,
    FAULTS,
    KINDS,
    NEEDS_ELASTIC,
    NEEDS_SPARES,
    ChaosOptions,
    Drill,
    Fault,
    _Tap,
    kinds_help,
    parse_schedule,
    restart_budget,
)
from scaletrain.app.cli import main
from scaletrain.app.stack import Workdir
from trainer.checkpoint.checkpointer import SaveKind, SaveStarted
from trainer.health.preflight import check_ranks, matmul_ok
from trainer.health.watchdog import (
    HANG_EXIT_CODE,
    PEERS_WAIT_S,
    WATCH_TICK_S,
    Hang,
    PeerBoard,
    Watchdog,
    WatchdogPolicy,
)
from trainer.train import _flush_on_termination


class DictStore:
    """The three calls PeerBoard makes of a c10d store."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(key in self.data for key in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]


def _watchdog(policy: WatchdogPolicy, peers: PeerBoard | None = None):
    fired: list[Hang] = []
    exits: list[int] = []
    beats: list[tuple[int, str]] = []
    dog = Watchdog(
        policy,
        2,
        heartbeat=lambda s, p: beats.append((s, p)),
        on_hang=fired.append,
        peers=peers,
        exit=exits.append,
    )
    return dog, fired, exits, beats


def test_the_watchdog_does_not_judge_start_up_before_the_first_step_ended():
    dog, *_ = _watchdog(WatchdogPolicy(min_s=0.01))
    dog.enter(1, "forward")
    time.sleep(0.05)
    assert dog.deadline_s() is None
    assert dog.check() is None


def test_the_deadline_is_the_floor_or_a_multiple_of_the_slowest_recent_step():
    dog, *_ = _watchdog(WatchdogPolicy(min_s=5.0, factor=10.0))
    dog.step_done(0.1)
    assert dog.deadline_s() == 5.0
    dog.step_done(2.0)
    assert dog.deadline_s() == 20.0


def test_a_hung_phase_fires_once_naming_rank_step_phase_and_the_stale_peer():
    store = DictStore()
    PeerBoard(store, 0, 3).publish(7, "forward")
    stale = {"step": 6, "phase": "backward", "time": time.time() - 60}
    store.data["heartbeat/1"] = json.dumps(stale).encode()
    dog, fired, exits, beats = _watchdog(
        WatchdogPolicy(min_s=0.2, factor=1.0, heartbeat_s=0.5), PeerBoard(store, 2, 3)
    )
    dog.step_done(0.01)
    dog.enter(7, "forward")
    dog.start()
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()
    assert exits == [HANG_EXIT_CODE]
    (hang,) = fired
    assert (hang.rank, hang.step, hang.phase) == (2, 7, "forward")
    assert hang.waited_s > hang.deadline_s == 0.2
    (stale_peer,) = hang.stale_peers  # rank 0 beat recently, rank 1 a minute ago
    assert stale_peer.startswith("rank 1 60.") and stale_peer.endswith("backward of step 6")
    assert "rank 2 made no progress in phase forward of step 7" in hang.message()
    assert beats[0] == (7, "forward")  # the first one as the watchdog starts
    assert json.loads(store.data["heartbeat/2"])["phase"] == "forward"


class FrozenStore(DictStore):
    """A store whose host is frozen (rank 0 under SIGSTOP): every call waits forever."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = threading.Event()

    def set(self, key: str, value: str) -> None:
        self.calls.set()
        threading.Event().wait()

    def check(self, keys: list[str]) -> bool:
        threading.Event().wait()
        return False


def test_a_hang_is_caught_on_time_while_the_heartbeat_store_does_not_answer():
    store = FrozenStore()
    dog, fired, exits, _ = _watchdog(
        WatchdogPolicy(min_s=0.3, factor=1.0, heartbeat_s=0.05), PeerBoard(store, 2, 3)
    )
    dog.step_done(0.01)
    dog.enter(4, "backward")
    threading.Thread(target=dog.start, daemon=True).start()
    assert store.calls.wait(5), "the heartbeat never reached the store"
    deadline = time.monotonic() + 0.3 + PEERS_WAIT_S + 3
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits == [HANG_EXIT_CODE], "the watchdog waited on the frozen store"
    (hang,) = fired
    assert (hang.step, hang.phase) == (4, "backward")
    assert hang.stale_peers == (
        f"peers unknown (their heartbeat store did not answer in {PEERS_WAIT_S:g}s)",
    )
    dog.stop()


def test_progress_keeps_the_watchdog_quiet():
    dog, fired, exits, _ = _watchdog(WatchdogPolicy(min_s=0.3, factor=1.0, heartbeat_s=0.05))
    dog.step_done(0.01)
    dog.start()
    for step in range(10):
        dog.enter(step, "forward")
        time.sleep(0.1)
    dog.stop()
    assert fired == [] and exits == []


def test_the_watchdog_signs_for_its_keeper_while_it_runs_and_stops_signing_when_stopped():
    signs: list[bool] = []
    dog = Watchdog(
        WatchdogPolicy(), 0, heartbeat=lambda s, p: None, on_hang=lambda h: None,
        alive=signs.append, exit=lambda code: None,
    ).start()  # fmt: skip
    time.sleep(3 * WATCH_TICK_S)
    dog.stop()
    assert len(signs) >= 2 and all(signs[:-1]) and signs[-1] is False


def test_a_peer_that_never_beat_is_named():
    assert PeerBoard(DictStore(), 0, 2).stale(1.0) == ("rank 1 (never)",)


@pytest.mark.parametrize("field", ["min_s", "factor", "heartbeat_s"])
def test_a_watchdog_setting_that_is_not_positive_is_refused(field: str):
    with pytest.raises(ValueError, match="must be positive"):
        WatchdogPolicy(**{field: 0.0})


def test_a_healthy_device_passes_the_matmul_check_and_a_corrupted_one_fails():
    assert matmul_ok(torch.device("cpu"))
    assert not matmul_ok(torch.device("cpu"), corrupt=True)


def test_a_failing_rank_is_named_by_the_health_check_before_start(tmp_path: Path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(30))
    try:
        check_ranks(torch.device("cpu"))
        with pytest.raises(Exception, match=r"health check before start failed: rank 0 on \S+ "
                           r"\(matmul wrong\)"):  # fmt: skip
            check_ranks(torch.device("cpu"), corrupt=True)
    finally:
        dist.destroy_process_group()


def test_a_schedule_is_parsed_in_step_order_with_default_outages():
    assert parse_schedule("stop-s3@9,kill-rank@4:0,kill-telemetry@6:2.5") == [
        Fault("kill-rank", 4, 0.0),
        Fault("kill-telemetry", 6, 2.5),
        Fault("stop-s3", 9, 30.0),
    ]


def test_the_default_drill_has_ten_faults_of_every_kind_but_those_needing_spares_or_elastic():
    faults = parse_schedule(DEFAULT_SCHEDULE)
    assert len(faults) >= 10
    assert {f.kind for f in faults} == set(KINDS) - NEEDS_SPARES - NEEDS_ELASTIC


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ("melt-cpu@3", "KIND@STEP"),
        ("kill-rank@0", "the step must be 1 or more"),
        (" , ", "--schedule is empty"),
        ("kill-rank@every90", r"KIND@STEP\[:SECONDS\] or KIND@everyNs"),
        ("kill-rank@every0s", "N of everyNs must be more than 0"),
        ("stop-s3@every1.2.3s", "N and SECONDS must be numbers"),
        ("sdc@every30s", "sdc strikes in its STEP only"),
    ],
)
def test_a_bad_schedule_is_refused_in_one_line(schedule: str, message: str):
    with pytest.raises(ValueError, match=message) as refused:
        parse_schedule(schedule)
    assert "\n" not in str(refused.value)


def test_a_repeating_fault_is_parsed_after_the_once_only_ones_with_its_period():
    assert parse_schedule("kill-rank@every90s,stop-s3@every45.5s:5,kill-ckptd@7") == [
        Fault("kill-ckptd", 7, 1.0),
        Fault("kill-rank", 0, 0.0, every_s=90.0),
        Fault("stop-s3", 0, 5.0, every_s=45.5),
    ]


def test_the_restart_budget_leaves_room_for_a_repeating_fault_that_restarts(tmp_path: Path):
    def budget(schedule: str, **given: int) -> int:
        return restart_budget(ChaosOptions(Workdir(tmp_path), parse_schedule(schedule), **given))

    assert budget("kill-rank@5,stop-s3@every9s") == 3
    assert budget("kill-rank@5,kill-rank@every90s") == 23
    assert budget("kill-rank@every90s", max_restarts=4) == 4


def test_the_help_lists_both_schedule_forms_and_every_kind_from_the_one_table():
    text = kinds_help()
    assert "KIND@STEP[:SECONDS] or KIND@everyNs[:SECONDS]" in text
    assert all(f"  {kind} " in text for kind in FAULTS)


def test_a_bad_restart_budget_or_late_fault_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    assert main(["run", "--workdir", str(tmp_path), "--max-restarts", "-1"]) == 1
    assert "--max-restarts must be 0 or more, got -1" in capsys.readouterr().err
    code = main(["chaos", "--workdir", str(tmp_path), "--steps", "5", "--schedule", "kill-rank@5"])
    assert code == 1
    assert "kill-rank@5 at or after the last step 5" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def test_a_repeating_fault_is_due_every_n_seconds_after_a_step_and_within_the_restart_budget(
    tmp_path: Path,
):
    """The drill's scheduler alone, on a job seen only through its output lines."""
    schedule = parse_schedule("kill-rank@every0.2s,stop-s3@3")
    options = ChaosOptions(Workdir(tmp_path), schedule, max_restarts=3)
    tap = _Tap(io.StringIO())
    stack = SimpleNamespace(telemetry_address="127.0.0.1:9", client_security=lambda role: None)
    drill = Drill(stack, options, "r1", tap)  # type: ignore[arg-type]
    try:
        once, due = [schedule[0]], {schedule[1]: drill.started_at + 0.2}
        tap.write("[trainer] run r1: 4 ranks, 1 parameters, steps 1..9\n[trainer] step 1 loss 1\n")
        assert drill._next_due(once, due, 0) == schedule[1]
        assert time.time() >= drill.started_at + 0.2
        assert due[schedule[1]] == pytest.approx(drill.started_at + 0.4)
        # At its step, the once-only one waits for a step after the previous fault, then comes
        # before the repeating one due too.
        tap.write("[trainer] step 3 loss 1\n")
        mark, waited = tap.mark(), time.time()
        threading.Timer(0.5, tap.write, ["[trainer] step 4 loss 1\n"]).start()
        assert drill._next_due(once, due, mark) == schedule[0] and once == []
        assert time.time() - waited >= 0.5
        # One restart used: striking again would leave fewer than 2 of the budget of 3.
        tap.write("[trainer] run r1: 4 ranks, 1 parameters, steps 2..9\n[trainer] step 5 loss 1\n")
        threading.Timer(0.6, drill.finish).start()
        assert drill._next_due(once, due, 0) is None
    finally:
        drill.close()


@pytest.mark.parametrize(("kind", "said"), [(SaveKind.DURABLE, [20]), (SaveKind.MEMORY, [])])
def test_a_rank_stopped_with_a_durable_save_in_flight_says_the_save_is_abandoned(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], kind: SaveKind, said
):
    """As when a machine joins during a save: the re-form stops the ranks, the save never
    commits, and the run goes on from its newest committed step; a memory save is no loss."""
    abandoned: list[int] = []
    exits: list[int] = []

    class Reporter:
        rank = 0

        def save_abandoned(self, step: int) -> None:
            abandoned.append(step)

        def flush(self, timeout_s: float) -> None:
            pass

    class Saving:
        def unfinished(self) -> SaveStarted:
            return SaveStarted(20, 0.0, 0, kind)

    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(os, "_exit", exits.append)
    try:
        _flush_on_termination(Reporter(), Saving())  # type: ignore[arg-type]
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert abandoned == said and exits == [128 + signal.SIGTERM]
    assert ("checkpoint of step 20 abandoned" in capsys.readouterr().err) == bool(said)
