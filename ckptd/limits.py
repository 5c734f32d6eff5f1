"""Fair shares: what one caller and one run may hold of a resource of ckptd, and the whole node.

Why: a limit that is only global lets one run, or one broken client, take all of it and stall
every other run on the node (400 uploads that never send their bytes once blocked every save for
the tickets' lifetime). Counting each resource per caller (its token; without tokens, its peer
host) and per run as well means a caller over its share is refused, naming its own count and
limit, while the other runs find room. The node-wide limit stays as the last bound.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

from scaletrain.errors import ResourceExhausted

SCOPES = ("caller", "run", "node")


class Owner(NamedTuple):
    """Who holds a share: the caller (a key that limits count by, and how a refusal names it)
    and the run it acts for."""

    caller: str
    label: str
    run: str


class OverShare(ResourceExhausted):
    """A share is full; `scope` says whose (caller, run or node)."""

    def __init__(self, scope: str, message: str) -> None:
        super().__init__(message)
        self.scope = scope


class Shares:
    """Amounts of one resource held per caller, per run and on the node, each under its limit.

    `take` refuses (or waits for) an amount that would take a holder past a limit; one that holds
    nothing yet is always given its first amount, so a frame bigger than a byte limit still
    moves, one at a time.
    """

    def __init__(
        self, what: str, caller: int, run: int, node: int, shown: Callable[[int], str] = str
    ) -> None:
        self._what, self._shown = what, shown
        self._limits = {"caller": caller, "run": run, "node": node}
        self._held: Counter[tuple[str, str]] = Counter()
        self._cond = threading.Condition()

    @staticmethod
    def _keys(owner: Owner) -> tuple[tuple[str, str], ...]:
        return (("caller", owner.caller), ("run", owner.run), ("node", ""))

    def held(self, owner: Owner) -> dict[str, int]:
        """What `owner`'s caller, its run and the node hold now."""
        with self._cond:
            return {scope: self._held[(scope, key)] for scope, key in self._keys(owner)}

    def _full(self, owner: Owner, amount: int) -> OverShare | None:
        """The refusal of `amount` more for `owner` (under the lock), or None if it fits."""
        for scope, key in self._keys(owner):
            held, limit = self._held[(scope, key)], self._limits[scope]
            if held and held + amount > limit:
                whose = {"caller": f"caller {owner.label}", "run": f"run {owner.run!r}"}
                return OverShare(
                    scope,
                    f"{whose.get(scope, 'this node')} holds {self._shown(held)} {self._what} "
                    f"(limit {self._shown(limit)} per {scope})",
                )
        return None

    def take(self, owner: Owner, amount: int = 1, wait_s: float = 0.0) -> None:
        """Count `amount` for `owner`; if it does not fit, wait while the holders give back
        (for up to `wait_s` without any of them giving back), then raise OverShare."""
        with self._cond:
            deadline = time.monotonic() + wait_s
            before = sum(self._held[key] for key in self._keys(owner))
            while (refusal := self._full(owner, amount)) is not None:
                now = time.monotonic()
                if now >= deadline:
                    raise refusal
                self._cond.wait(min(deadline - now, 0.5))
                after = sum(self._held[key] for key in self._keys(owner))
                if after < before:  # it moves: wait on
                    deadline = time.monotonic() + wait_s
                before = after
            for key in self._keys(owner):
                self._held[key] += amount

    def give(self, owner: Owner, amount: int = 1) -> None:
        with self._cond:
            for key in self._keys(owner):
                self._held[key] -= amount
                if self._held[key] <= 0:
                    del self._held[key]
            self._cond.notify_all()
