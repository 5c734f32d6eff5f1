"""The kinds of fault a drill strikes, in one table (`FAULTS`), and the schedule of them.

A kind says what it does (`scaletrain chaos --help`), the SECONDS it lasts when a schedule item
leaves them out, how it strikes (a function of `scaletrain.app.chaos.strikes`,
`scaletrain.app.chaos.machines` or `scaletrain.app.chaos.disk`, given the drill and the fault),
what the job needs to survive it and which sign shows that the job saw it.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scaletrain.app.chaos import disk, machines, strikes

if TYPE_CHECKING:
    from scaletrain.app.chaos.drill import ChaosOptions, Drill

# The drill of `scaletrain chaos` without --schedule: every kind but those that need spares
# (NEEDS_SPARES: their drills are in tests/e2e), 16 faults over its 400 steps (`default_schedule`
# leaves out those of MULTI_NODE on one node). The long outages come late: the job trains on
# through them, so they move later faults on.
DEFAULT_SCHEDULE = (
    "sdc@5,kill-rank@10,kill-telemetry@20,stop-rank@30,kill-ckptd@40,corrupt-shard@50,sdc@60,"
    "kill-rank-twice@70,stop-s3@80,partition-node@90,disk-full@100,kill-telemetry@110,"
    "kill-ckptd@120,kill-node@130,kill-node-mid-save@140,kill-rendezvous@150"
)
# A repeating fault that restarts the job strikes while this many restarts of the budget are left
# (after the once-only faults' own), and the budget without --max-restarts has this many for it.
SPARE_RESTARTS = 2
_REPEAT_RESTARTS = 20
# torchrun's agent stopping its ranks (to restart them, or at the end), as it logs it for ranks
# it exec'd and for ranks it forked warm.
AGENT_STOPPED_RANKS = r"closing signal SIG|Closing process \d+ via signal"
# The first signs of a fault (`FaultKind.detected_by`): a rank or its agent failing (a survivor's
# traceback, the agent stopping the others or reporting the exit), a save failing, ...
_RANK_FAILED = (
    rf"\]: Traceback|{AGENT_STOPPED_RANKS}|failed \(exitcode: |error: watchdog:"
    r"|a collective failed: |^\[keeper\] in-job restart"
)
_SAVE_FAILED = r"checkpoint of step \d+ failed|^event checkpoint_failed: "


@dataclass(frozen=True)
class Fault:
    kind: str
    # The step after which it strikes once (0 for a repeating fault).
    step: int
    seconds: float = 0.0
    # It strikes every `every_s` seconds of the job instead (0: once, after `step`).
    every_s: float = 0.0


@dataclass(frozen=True)
class FaultKind:
    """A kind of fault, in one place: what it does, how its schedule item is read, how it
    strikes."""

    # What it does, for `scaletrain chaos --help`.
    describe: str
    # Strikes `fault` on the drill's job: (its target, what happened).
    inject: Callable[[Drill, Fault], tuple[str, str]]
    # SECONDS of KIND@STEP[:SECONDS] when the item leaves it out.
    default_seconds: float = 0.0
    # torchrun must restart the job after it.
    restarts: bool = False
    # Nodes a job needs to survive it.
    min_nodes: int = 1
    # Hot spares it needs (--spares).
    min_spares: int = 0
    # Trainer flags that make the trainer itself strike it, on the given rank.
    trainer_args: Callable[[Fault, int], list[str]] | None = None
    # It fills the SSD tier's disk, which must then be a small tmpfs.
    fills_disk: bool = False
    # It resizes the job: an elastic one (--nodes MIN:MAX) only.
    elastic: bool = False
    # The first sign that the job saw it: a regex searched in the job's output lines, telemetry's
    # events ("event KIND: MESSAGE") and ckptd's log ("ckptd: MESSAGE"), from the strike on.
    detected_by: str = _RANK_FAILED


# One item of --schedule: KIND@STEP[:SECONDS] or KIND@everyNs[:SECONDS] (SCHEDULE_FORMS says so).
_ITEM = re.compile(r"([a-z0-9-]+)@(?:(\d+)|every([0-9.]+)s)(?::([0-9.]+))?")
SCHEDULE_FORMS = "KIND@STEP[:SECONDS] or KIND@everyNs[:SECONDS]"


def parse_schedule(text: str) -> list[Fault]:
    """KIND@STEP[:SECONDS] and KIND@everyNs[:SECONDS],... in step order (the repeating ones
    last); ValueError names the bad item in one line."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = _ITEM.fullmatch(item)
        if match is None or match[1] not in FAULTS:
            raise ValueError(
                f"--schedule item {item!r}: expected {SCHEDULE_FORMS} with KIND one of "
                f"{', '.join(KINDS)}"
            )
        kind = FAULTS[match[1]]
        try:
            every = float(match[3] or 0)
            seconds = float(match[4] or kind.default_seconds)
        except ValueError:
            raise ValueError(f"--schedule item {item!r}: N and SECONDS must be numbers") from None
        step = int(match[2] or 0)
        if match[2] is not None and step < 1:
            raise ValueError(f"--schedule item {item!r}: the step must be 1 or more")
        if match[3] is not None and every <= 0:
            raise ValueError(f"--schedule item {item!r}: N of everyNs must be more than 0")
        if every and kind.trainer_args is not None:
            raise ValueError(f"--schedule item {item!r}: {match[1]} strikes in its STEP only")
        faults.append(Fault(match[1], step, seconds, every))
    if not faults:
        raise ValueError(f"--schedule is empty: give at least one {SCHEDULE_FORMS}")
    return sorted(faults, key=lambda f: (f.every_s > 0, f.step))


def restart_budget(options: ChaosOptions) -> int:
    """The restarts torchrun may do: --max-restarts, else one per once-only fault that restarts,
    SPARE_RESTARTS more, and _REPEAT_RESTARTS more for repeating ones that restart."""
    if options.max_restarts is not None:
        return options.max_restarts
    once = sum(FAULTS[f.kind].restarts for f in options.schedule if not f.every_s)
    repeating = any(FAULTS[f.kind].restarts for f in options.schedule if f.every_s)
    return once + SPARE_RESTARTS + (_REPEAT_RESTARTS if repeating else 0)


def default_schedule(nodes: int) -> str:
    """The drill without --schedule on `nodes` nodes: DEFAULT_SCHEDULE, less what one node cannot
    survive."""
    if nodes > 1:
        return DEFAULT_SCHEDULE
    items = DEFAULT_SCHEDULE.split(",")
    return ",".join(item for item in items if item.split("@")[0] not in MULTI_NODE)


FAULTS: dict[str, FaultKind] = {
    "kill-rank": FaultKind(
        "SIGKILL a random rank in the middle of the next step; the keepers fork every rank "
        "again in-job (torchrun's agent restarts the job when they cannot), which resumes from "
        "the latest committed checkpoint.",
        strikes.kill_rank,
        restarts=True,
    ),
    "kill-rank-twice": FaultKind(
        "SIGKILL a random rank, then another as soon as the job's ranks were started again, "
        "before the job trained a step: two failures inside one recovery, which the keepers "
        "(or torchrun's agent) mend again; it resumes from the same checkpoint.",
        strikes.kill_rank_twice,
        restarts=True,
    ),
    "stop-rank": FaultKind(
        "SIGSTOP a random rank (a hang) until a watchdog fires, then SIGCONT it (if its keeper "
        "has not replaced it yet); the job restarts.",
        strikes.stop_rank,
        restarts=True,
        detected_by=r"error: watchdog:",
    ),
    "kill-ckptd": FaultKind(
        "SIGKILL ckptd right after the next checkpoint was staged (its upload in flight), restart "
        "it SECONDS later (default 1) on the same data dir.",
        strikes.kill_ckptd,
        default_seconds=1.0,
        detected_by=_SAVE_FAILED,
    ),
    "stop-s3": FaultKind(
        "stop the S3 server for SECONDS (default 30), then start it again.",
        strikes.stop_s3,
        default_seconds=30.0,
        detected_by=r"^ckptd: S3 job .* failed",
    ),
    "disk-full": FaultKind(
        "fill the SSD tier's disk (a size-limited tmpfs, which needs root) until a save fails or "
        "SECONDS pass (default 60), then free it.",
        disk.disk_full,
        default_seconds=60.0,
        fills_disk=True,
        detected_by=_SAVE_FAILED,
    ),
    "corrupt-shard": FaultKind(
        "Freeze the ranks, damage one shard of the latest checkpoint on SSD, restart ckptd (its "
        "memory tier gone), drop the ranks' own copies, then SIGKILL a rank, so that the resume "
        "must find the damage and read the S3 copy.",
        strikes.corrupt_shard,
        restarts=True,
    ),
    "kill-telemetry": FaultKind(
        "SIGKILL the telemetry service, restart it SECONDS later (default 3).",
        strikes.kill_telemetry,
        default_seconds=3.0,
        detected_by=r"^telemetry: keeping \d+ records",
    ),
    "sdc": FaultKind(
        "flip a bit of a random rank's gradients in step STEP (--inject-sdc): the step guard must "
        "catch and replay it.",
        strikes.sdc,
        trainer_args=strikes.sdc_flags,
        detected_by=r"^event sdc: ",
    ),
    "kill-node": FaultKind(
        "(--nodes 2 or more) a machine replaced: SIGKILL a random node's torchrun agent, its ranks "
        "and its ckptd, delete its ckptd's data dir (its SSD), start a fresh ckptd with an empty "
        "one at the same address, then the node's agent again (with --spares, a warm spare takes "
        "its place first and the fresh machine becomes a spare); the other agents restart their "
        "ranks and the job re-forms with it. Never node0: the drill asks its ckptd. The node's "
        "ranks are frozen first, until every committed checkpoint is on S3 or node-loss safe: "
        "a part that only the dead machine held could not survive it, so the drill strikes "
        "when none is (kill-node-mid-save strikes when one is).",
        machines.kill_node,
        restarts=True,
        min_nodes=2,
    ),
    "lose-node": FaultKind(
        "(--nodes MIN:MAX) a machine lost for good: kill-node, but no machine comes in its place "
        "(with --spares a waiting spare still does): the job re-forms on the nodes that remain, "
        "resharding its state, with the same global batch and data order.",
        machines.lose_node_for_good,
        restarts=True,
        min_nodes=2,
        elastic=True,
    ),
    "return-node": FaultKind(
        "(--nodes MIN:MAX) a machine lost for good comes back: a fresh ckptd and agent at its "
        "address; the job takes it in at its next rendezvous round and grows, resharding again.",
        machines.return_node,
        restarts=True,
        min_nodes=2,
        elastic=True,
    ),
    "kill-node-mid-save": FaultKind(
        "(--nodes 2 or more) as kill-node, but in the instant after the next save commits, "
        "before its part is copied to a peer (the drill slows copies to 2 MB/s until then): that "
        "step may be lost with the node, having never been node-loss safe; the job must resume "
        "from the newest step it can still restore.",
        machines.kill_node_mid_save,
        restarts=True,
        min_nodes=2,
    ),
    "flaky-node": FaultKind(
        "(--spares 1 or more) SIGKILL a rank of a random node again and again, each time once "
        "the job trains again, until the node is cordoned (--cordon-after failures of its ranks) "
        "and a waiting spare takes its place; the cordoned machine does not come back.",
        machines.flaky_node,
        restarts=True,
        min_nodes=2,
        min_spares=1,
    ),
    "corrupting-rank": FaultKind(
        "(--spares 1 or more) a machine that corrupts: a bit of a random rank's gradients "
        "flipped in step STEP and again two steps later (--inject-sdc twice); the step guard "
        "replays both, the second finding quarantines the rank (--quarantine cordon), its "
        "machine is cordoned and a waiting spare takes its place.",
        machines.corrupting_rank,
        trainer_args=machines.corrupting_rank_flags,
        restarts=True,
        min_nodes=2,
        min_spares=1,
        detected_by=r"\[trainer\] quarantine: ",
    ),
    "kill-spare-taking-over": FaultKind(
        "(--spares 1 or more) as kill-node, then SIGKILL the spare taking the node's place as "
        "soon as it runs ranks: the job finds it lost and goes on with the next machine (the "
        "one lost first, back as a spare).",
        machines.kill_spare_taking_over,
        restarts=True,
        min_nodes=2,
        min_spares=1,
    ),
    "kill-rendezvous": FaultKind(
        "(--nodes 2 or more) SIGKILL the rendezvous service the agents meet in: torch's agents "
        "cannot reconnect to its store, so the stack starts it again at its address, then "
        "every agent; the job resumes from its newest checkpoint.",
        strikes.kill_rendezvous,
        restarts=True,
        min_nodes=2,
        detected_by=r"^\[scaletrain\] the rendezvous at \S+ was lost",
    ),
    "partition-node": FaultKind(
        "freeze a random node's ckptd (SIGSTOP) for SECONDS (default 5), then SIGCONT: its ranks "
        "and its peers cannot reach it meanwhile.",
        strikes.partition_node,
        default_seconds=5.0,
        detected_by=_SAVE_FAILED,
    ),
}
KINDS = tuple(FAULTS)
# Faults that need another node to survive them, and those that need a spare.
MULTI_NODE = frozenset(kind for kind, fault in FAULTS.items() if fault.min_nodes > 1)
NEEDS_SPARES = frozenset(kind for kind, fault in FAULTS.items() if fault.min_spares > 0)
# Faults that resize the job: an elastic one only (--nodes MIN:MAX).
NEEDS_ELASTIC = frozenset(kind for kind, fault in FAULTS.items() if fault.elastic)


def kinds_help() -> str:
    """Every kind and what it does, for `scaletrain chaos --help`."""
    lines = [
        f"fault kinds ({SCHEDULE_FORMS}: once after step STEP,",
        "or every N seconds of the job; SECONDS: how long the fault lasts):",
    ]
    width = max(map(len, FAULTS)) + 2
    for kind, fault in FAULTS.items():
        lines += textwrap.wrap(
            fault.describe,
            79,
            initial_indent=f"  {kind:<{width}}",
            subsequent_indent=" " * (width + 2),
        )
    return "\n".join(lines)
