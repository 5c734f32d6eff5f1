"""Quarantine: a rank the silent-data-corruption checks keep naming is taken out of the job.

One corruption is a transient fault, and the step guard puts it right (a replay, the copy of the
state restored). A rank named again is a machine that corrupts: every replay it causes costs a
step, and the next flip may land where no check looks. So the `after`-th naming of one rank
quarantines it, once:
- rank 0 records a `quarantine` event with the evidence (the rank, its machine, the steps) and
  prints `scaletrain.cordon.quarantine_line`, which the embedded stack reads;
- under `--quarantine cordon` the named rank also records a QUARANTINED failure for its machine's
  agent (on a cluster: `scaletrain.cordon.FailureWatch`). Either observer cordons the machine at
  once: a waiting spare takes its place through the recovery path, and the job resumes from its
  newest checkpoint (the guard already kept the corrected state);
- under `--quarantine alert` the rank stays, and the finding is only reported.

Every rank sees the same findings (the guard gathers every rank's view of each step), so every
rank counts the same, with no collective of its own.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

from scaletrain.cordon import QUARANTINED, quarantine_line, record_failure

# report(kind, step, rank, message, attributes): an event for telemetry (the guard's `Report`).
Report = Callable[[str, int, int, str, dict[str, str]], None]


class Quarantine:
    """Counts the silent-data-corruption findings naming each rank and quarantines a rank at its
    `after`-th; `policy` is one of trainer.health.QUARANTINE_POLICIES. `hosts`: each rank's
    machine, by rank (empty when not known)."""

    def __init__(self, policy: str, after: int, hosts: list[str], rank: int, report: Report):
        self.policy, self.after, self._hosts = policy, after, hosts
        self._rank, self._report = rank, report
        self._steps: dict[int, list[int]] = defaultdict(list)
        self.quarantined: set[int] = set()

    def named(self, step: int, ranks: Iterable[int]) -> None:
        """The checks found `ranks` corrupting at `step` (one finding per rank)."""
        if self.policy == "off":
            return
        for rank in ranks:
            steps = self._steps[rank]
            steps.append(step)
            if len(steps) == self.after and rank not in self.quarantined:
                self.quarantined.add(rank)
                self._take_out(rank, step, steps)

    def _take_out(self, rank: int, step: int, steps: list[int]) -> None:
        host = self._hosts[rank] if rank < len(self._hosts) else ""
        line = quarantine_line(rank, host, steps, self.policy)
        if self._rank == 0:
            print(line, flush=True)
            self._report(
                "quarantine",
                step,
                rank,
                line.removeprefix("[trainer] quarantine: "),
                {
                    "node": host,
                    "steps": ",".join(map(str, steps)),
                    "policy": self.policy,
                },
            )
        if self.policy == "cordon" and self._rank == rank:
            record_failure(
                rank,
                step,
                f"{QUARANTINED}: named by the silent-data-corruption checks at steps "
                f"{', '.join(map(str, steps))}",
            )
