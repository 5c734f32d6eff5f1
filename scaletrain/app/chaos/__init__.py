"""`scaletrain chaos`: a drill that trains on the embedded stack while a schedule of faults strikes.

The schedule is a list of KIND@STEP[:SECONDS], each fault injected once, in order, as soon as the
job has finished step STEP (the job is watched through its `[trainer] step N` lines), and of
KIND@everyNs[:SECONDS], a fault struck every N seconds of the job for as long as it runs, as a
cluster's faults come. Each kind is defined once, in `FAULTS`: what it does, the SECONDS it lasts
when the item does not say, how the drill strikes and which sign shows that the job saw it
(`scaletrain chaos --help` lists them).

Every fault is recorded in telemetry as a `fault` event, and once the job ended as a `recovery`
event with its recovery record (`scaletrain.app.recovery`: injected, detected, first step after,
MTTR, steps lost, what restored the state). The report says how many faults were injected and
survived, how many committed checkpoints were lost (any checkpoint ever seen committed on some
tier must still be committed on one at the end), how many steps were computed again after
restarts, each fault's recovery, the run's goodput from telemetry with what each kind of fault
cost, and the effective training time (the time in steps that were kept over the job's wall time).

The modules, each on those below it:
- `run`: `chaos`, the drill from start to end, and its `ChaosReport`.
- `drill`: `Drill`, which strikes each fault when due and records it, and `ChaosOptions`.
- `faults`: the table of fault kinds (`FAULTS`), each naming the function that strikes it, and
  the schedule (`parse_schedule`, `DEFAULT_SCHEDULE`, the restart budget).
- `strikes`: the strikes on a rank, a service or a shard; `machines`: those that take a whole
  node; `disk`: disk-full and the small tmpfs it needs.
- `watch`: what the drill watches, the job's output lines (`_Tap`) and what ckptd lists as
  committed.
"""

from scaletrain.app.chaos.disk import can_mount_tmpfs
from scaletrain.app.chaos.drill import ChaosOptions, Drill
from scaletrain.app.chaos.faults import (
    AGENT_STOPPED_RANKS,
    DEFAULT_SCHEDULE,
    FAULTS,
    KINDS,
    MULTI_NODE,
    NEEDS_ELASTIC,
    NEEDS_SPARES,
    Fault,
    default_schedule,
    kinds_help,
    parse_schedule,
    restart_budget,
)
from scaletrain.app.chaos.run import ChaosReport, chaos
from scaletrain.app.chaos.watch import _Tap

__all__ = [
    "AGENT_STOPPED_RANKS",
    "DEFAULT_SCHEDULE",
    "FAULTS",
    "KINDS",
    "MULTI_NODE",
    "NEEDS_ELASTIC",
    "NEEDS_SPARES",
    "ChaosOptions",
    "ChaosReport",
    "Drill",
    "Fault",
    "_Tap",
    "can_mount_tmpfs",
    "chaos",
    "default_schedule",
    "kinds_help",
    "parse_schedule",
    "restart_budget",
]
