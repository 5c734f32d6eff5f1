"""The watchdog of one rank: a heartbeat to telemetry, and a clean failure for a hung step.

A rank stuck in a collective (a peer hung, say) never fails by itself until the collective times
out, and then says little. The loop tells the watchdog where it is (`enter(step, phase)`) and when
a step ended (`step_done(seconds)`). Two threads of its own:
  - one sends a heartbeat event (step, phase) to telemetry every `heartbeat_s`, and publishes the
    same in the job's rendezvous store, where the other ranks' watchdogs can read it;
  - the other, once the first step ended, fires when the current phase has made no progress
    within a deadline derived from recent step times (`factor` x the slowest of the last few,
    never below `min_s`). It judges from this process's memory, never waiting on the store, so
    a frozen store cannot delay it. It prints a one-line diagnostic naming this rank, the step
    and the phase, and the ranks whose heartbeat went stale (a stopped or hung peer), reports a
    `hang` event, and ends the process with HANG_EXIT_CODE so that torchrun's agent restarts
    the job from its latest checkpoint.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# What the process exits with when the watchdog fires (distinct from a crash's 1 and signals).
HANG_EXIT_CODE = 75
# Step times the deadline is derived from.
RECENT_STEPS = 20
# How long the firing watchdog waits for its telemetry event to be sent.
REPORT_WAIT_S = 2.0
# How long the firing watchdog waits to read its peers' heartbeats from the job's store.
PEERS_WAIT_S = 2.0
# How often the judging thread looks, and signs that the process is alive (`alive`).
WATCH_TICK_S = 0.5


@dataclass(frozen=True)
class WatchdogPolicy:
    """Deadline = max(min_s, factor x the slowest recent step); heartbeat every heartbeat_s."""

    min_s: float = 120.0
    factor: float = 10.0
    heartbeat_s: float = 10.0

    def __post_init__(self) -> None:
        for flag, value in (
            ("--watchdog-min-s", self.min_s),
            ("--watchdog-factor", self.factor),
            ("--heartbeat-s", self.heartbeat_s),
        ):
            if not value > 0:
                raise ValueError(f"{flag} must be positive, got {value}")


@dataclass(frozen=True)
class Hang:
    """What the watchdog saw when it fired."""

    rank: int
    step: int
    phase: str
    waited_s: float
    deadline_s: float
    stale_peers: tuple[str, ...]

    def message(self) -> str:
        peers = f"; stale heartbeat: {', '.join(self.stale_peers)}" if self.stale_peers else ""
        return (
            f"watchdog: rank {self.rank} made no progress in phase {self.phase} of step "
            f"{self.step} for {self.waited_s:.1f}s (deadline {self.deadline_s:.1f}s){peers}"
        )


class PeerBoard:
    """Each rank's latest heartbeat in a key-value store shared by the job (torchrun's)."""

    def __init__(self, store: object, rank: int, world: int) -> None:
        self._store, self._rank, self._world = store, rank, world

    def publish(self, step: int, phase: str) -> None:
        beat = {"step": step, "phase": phase, "time": time.time()}
        self._store.set(f"heartbeat/{self._rank}", json.dumps(beat))  # type: ignore[attr-defined]

    def stale(self, older_than_s: float) -> tuple[str, ...]:
        """Peers whose last heartbeat is older than `older_than_s` (or never came)."""
        now, found = time.time(), []
        for peer in range(self._world):
            if peer == self._rank:
                continue
            key = f"heartbeat/{peer}"
            if not self._store.check([key]):  # type: ignore[attr-defined]
                found.append(f"rank {peer} (never)")
                continue
            beat = json.loads(self._store.get(key))  # type: ignore[attr-defined]
            age = now - beat["time"]
            if age > older_than_s:
                found.append(
                    f"rank {peer} {age:.1f}s ago in phase {beat['phase']} of step {beat['step']}"
                )
        return tuple(found)


class Watchdog:
    """Watches the loop of rank `rank`; `on_hang` is called (then the process exits) when it fires.

    Two threads: one sends `heartbeat(step, phase)` and publishes it to the peers every
    `policy.heartbeat_s`; the other judges progress from this process's own memory alone. A
    store call that hangs (rank 0, which hosts the store, frozen) then stalls only the heartbeat,
    never the judgement: the peers' heartbeats are read only when the watchdog fires, and for at
    most PEERS_WAIT_S.
    """

    def __init__(
        self,
        policy: WatchdogPolicy,
        rank: int,
        *,
        heartbeat: Callable[[int, str], None],
        on_hang: Callable[[Hang], None],
        peers: PeerBoard | None = None,
        alive: Callable[[bool], None] = lambda judged: None,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.policy, self.rank = policy, rank
        self._heartbeat, self._on_hang, self._peers, self._exit = heartbeat, on_hang, peers, exit
        self._alive = alive
        self._lock = threading.Lock()
        self._step, self._phase = 0, "start"
        self._since = time.monotonic()
        self._recent: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._watch, name="watchdog", daemon=True),
            threading.Thread(target=self._beat_loop, name="watchdog-heartbeat", daemon=True),
        ]

    def start(self) -> Watchdog:
        for thread in self._threads:
            thread.start()
        return self

    def enter(self, step: int, phase: str) -> None:
        """The loop starts `phase` of `step`: progress."""
        with self._lock:
            self._step, self._phase, self._since = step, phase, time.monotonic()

    def step_done(self, seconds: float) -> None:
        with self._lock:
            self._recent.append(seconds)

    def deadline_s(self) -> float | None:
        """Seconds a phase may take; None until a step ended (start-up is not watched)."""
        with self._lock:
            if not self._recent:
                return None
            return max(self.policy.min_s, self.policy.factor * max(self._recent))

    def check(self) -> Hang | None:
        """The hang, if the current phase is past its deadline."""
        deadline = self.deadline_s()
        with self._lock:
            step, phase, waited = self._step, self._phase, time.monotonic() - self._since
        if deadline is None or waited <= deadline:
            return None
        return Hang(self.rank, step, phase, waited, deadline, self._stale_peers())

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            if thread.is_alive():
                # A heartbeat stuck in a store call must not hold up the rank's exit.
                thread.join(timeout=PEERS_WAIT_S)
        self._alive(False)  # after the judging thread's last sign: the rank goes on unjudged

    def _watch(self) -> None:
        self._alive(True)
        while not self._stop.wait(min(WATCH_TICK_S, self.policy.heartbeat_s)):
            self._alive(True)  # the process runs: its keeper judges that, this thread the work
            hang = self.check()
            if hang is not None:
                self._fire(hang)
                return

    def _beat_loop(self) -> None:
        # A first heartbeat at once: a rank that hangs within the first interval is then
        # named with its phase by its peers, not as one that never beat.
        while True:
            with self._lock:
                step, phase = self._step, self._phase
            self._beat(step, phase)
            if self._stop.wait(self.policy.heartbeat_s):
                return

    def _beat(self, step: int, phase: str) -> None:
        peers = self._peers
        if peers is not None:
            try:
                peers.publish(step, phase)
            except Exception as exc:  # a store that went away must not kill a healthy rank
                self._drop_peers(exc)
        self._heartbeat(step, phase)

    def _stale_peers(self) -> tuple[str, ...]:
        """The peers whose heartbeat went stale, read in a thread of its own so that a store
        that does not answer delays the verdict by PEERS_WAIT_S at most."""
        peers = self._peers
        if peers is None:
            return ()
        found: list[tuple[str, ...]] = []

        def read() -> None:
            try:
                found.append(peers.stale(2 * self.policy.heartbeat_s))
            except Exception as exc:  # the store of the peers' heartbeats went away
                self._drop_peers(exc)

        reader = threading.Thread(target=read, name="watchdog-peers", daemon=True)
        reader.start()
        reader.join(PEERS_WAIT_S)
        if found:
            return found[0]
        if reader.is_alive():
            return (f"peers unknown (their heartbeat store did not answer in {PEERS_WAIT_S:g}s)",)
        return ()

    def _drop_peers(self, exc: Exception) -> None:
        print(
            f"[trainer] rank {self.rank}: watchdog: peers' heartbeats unavailable: {exc}",
            file=sys.stderr,
            flush=True,
        )
        self._peers = None

    def _fire(self, hang: Hang) -> None:
        print(f"trainer: rank {self.rank}: error: {hang.message()}", file=sys.stderr, flush=True)
        try:
            self._on_hang(hang)
        finally:
            self._exit(HANG_EXIT_CODE)
