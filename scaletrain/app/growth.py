"""When an elastic job takes in a machine that waits to join: at once, unless the job is flapping.

A machine that joins and leaves again and again (a bad NIC, a node the cloud keeps taking back)
would put an elastic job into a resize loop: every grow and every loss stops all ranks and
re-forms the job, and the job trains little in between. So every re-form of the job is
recorded (`Growth.formed`): a node lost within FLAP_WINDOW_S of the grow that took one in is a
flap, and after each flap a waiting machine is held back longer before the job grows again
(GROW_HOLD_BASE_S, doubling up to GROW_HOLD_MAX_S). A grow that holds for FLAP_WINDOW_S clears
the hold (a size the hold itself kept the job at does not). Losses are never held back: the job
cannot train on without re-forming.

Every agent of the job must judge alike (any one that restarts its ranks re-forms the whole
job), and a machine that has just joined knows nothing of what came before it. The record
therefore lives in the rendezvous store, beside torch's own state (`GrowthRecord`), and each
round's re-form updates it once, whichever agent gets there first.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Protocol

# A node lost this soon (seconds) after the grow that took one in: a flap.
FLAP_WINDOW_S = 120.0
# The hold after the first flap, and the most it doubles to. Below the rendezvous'
# join_timeout (--capacity-wait-s, 600 s by default), or a held machine gives up waiting.
GROW_HOLD_BASE_S = 15.0
GROW_HOLD_MAX_S = 300.0


@dataclass(frozen=True)
class Growth:
    """The job's last re-form (its rendezvous round, size in nodes, wall-clock time), when it
    last grew, and how long it now holds a waiting machine back."""

    round: int = -1
    size: int = 0
    formed_at: float = 0.0
    grew_at: float = -math.inf
    hold_s: float = 0.0

    def formed(self, round_: int, size: int, now: float) -> Growth:
        """The record after the job formed round `round_` with `size` nodes at `now` (itself
        for a round it already holds: every agent reports each round)."""
        if round_ <= self.round:
            return self
        hold, shrinks = self.hold_s, 0 < size < self.size
        since_grow = now - self.grew_at
        if shrinks and since_grow < FLAP_WINDOW_S:
            hold = min(max(2 * hold, GROW_HOLD_BASE_S), GROW_HOLD_MAX_S)
        elif since_grow >= FLAP_WINDOW_S and (shrinks or self.grew_at == self.formed_at):
            hold = 0.0  # the last grow held for the window: not flapping (any more)
        grew_at = now if self.size and size > self.size else self.grew_at
        return Growth(round_, size, now, grew_at, hold)

    def grows_in(self, now: float) -> float:
        """Seconds until a waiting machine may join (0: now)."""
        return max(self.formed_at + self.hold_s - now, 0.0)

    def to_json(self) -> str:
        return json.dumps({k: (v if v != -math.inf else None) for k, v in asdict(self).items()})

    @classmethod
    def from_json(cls, text: str) -> Growth:
        fields = json.loads(text)
        if fields["grew_at"] is None:
            fields["grew_at"] = -math.inf
        return replace(cls(), **fields)


class Store(Protocol):
    """What GrowthRecord needs of a c10d store."""

    def check(self, keys: list[str]) -> bool: ...

    def get(self, key: str) -> bytes: ...

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...


class GrowthRecord:
    """The job's `Growth`, kept in the rendezvous store under the run's key."""

    def __init__(self, store: Store, run_id: str) -> None:
        self._store = store
        self._key = f"scaletrain.growth.{run_id}"

    def read(self) -> tuple[Growth, str]:
        """The record, and its text as stored ("" for none yet)."""
        if not self._store.check([self._key]):
            return Growth(), ""
        text = self._store.get(self._key).decode()
        return Growth.from_json(text), text

    def formed(self, round_: int, size: int, now: float | None = None) -> Growth:
        """Record that the job formed round `round_` with `size` nodes: once per round, by
        whichever agent swaps it in first (compare-and-set)."""
        now = time.time() if now is None else now
        while True:
            growth, text = self.read()
            updated = growth.formed(round_, size, now)
            if updated is growth:
                return growth
            new = updated.to_json()
            if self._store.compare_set(self._key, text, new).decode() == new:
                return updated
