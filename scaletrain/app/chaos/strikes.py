"""The strikes on one process of the job: a rank, a service (ckptd, S3, telemetry, the
rendezvous), a shard of a checkpoint.

Each takes the drill and its fault and returns (its target, what happened), as `FaultKind.inject`
says; those that lose a whole machine are in `scaletrain.app.chaos.machines`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import TYPE_CHECKING

from scaletrain.app.chaos.disk import ssd_dir
from scaletrain.app.chaos.watch import WAIT_S, JobEnded, committed_on, wait_on_s3
from scaletrain.app.stack import RENDEZVOUS, ckptd_service, node_name

if TYPE_CHECKING:
    from scaletrain.app.chaos.drill import Drill
    from scaletrain.app.chaos.faults import Fault


def kill_rank(drill: Drill, fault: Fault) -> tuple[str, str]:
    attempts = drill.tap.attempts
    rank, pid = drill.victim(fault)
    os.kill(pid, signal.SIGKILL)
    return f"rank {rank}", f"SIGKILL to pid {pid} during step {drill.tap.step + 1}" + (
        drill.await_restart(attempts)
    )


def kill_rank_twice(drill: Drill, fault: Fault) -> tuple[str, str]:
    """Kill a rank, then another rank of the job started again, before it trained a step: two
    failures inside one recovery."""
    assert drill.job is not None
    attempts, mark = drill.tap.attempts, drill.tap.mark()
    rank, pid = drill.victim(fault)
    before = set(drill.job.rank_pids().values())
    os.kill(pid, signal.SIGKILL)
    ranks, pick = drill.options.ranks, drill.random_for(fault)
    again = rank if ranks == 1 else (rank + 1 + pick.randrange(ranks - 1)) % ranks
    deadline = time.monotonic() + WAIT_S
    while not drill.done.is_set() and time.monotonic() < deadline:
        started = drill.job.rank_pids().get(again)
        if started is not None and started not in before:
            break
        time.sleep(0.05)  # a scan of /proc each time; the restart takes a second
    else:
        raise JobEnded
    with contextlib.suppress(ProcessLookupError):
        os.kill(started, signal.SIGKILL)
    when = (
        "after it trained again"
        if drill.tap.seen_since(mark, "[trainer] step ")
        else "before it trained a step"
    )
    return f"rank {rank}", (
        f"SIGKILL to pid {pid} during step {drill.tap.step + 1}, then to rank {again}'s new "
        f"pid {started} {when}" + drill.await_restart(attempts)
    )


def stop_rank(drill: Drill, fault: Fault) -> tuple[str, str]:
    attempts, mark = drill.tap.attempts, drill.tap.mark()
    rank, pid = drill.victim(fault)
    os.kill(pid, signal.SIGSTOP)
    fired = drill.tap.wait(
        lambda: drill.done.is_set() or drill.tap.seen_since(mark, "error: watchdog:")
    )
    with contextlib.suppress(ProcessLookupError):  # its keeper may have replaced it
        os.kill(pid, signal.SIGCONT)
    verdict = "a watchdog fired" if fired else "no watchdog fired"
    return f"rank {rank}", f"SIGSTOP to pid {pid}: {verdict}" + drill.await_restart(attempts)


def kill_ckptd(drill: Drill, fault: Fault) -> tuple[str, str]:
    mark = drill.tap.mark()
    drill.tap.wait(lambda: drill.done.is_set() or drill.tap.seen_since(mark, "checkpoint staged"))
    if drill.done.is_set():
        raise JobEnded
    drill.struck_step = drill.tap.step
    drill.stack.service("ckptd").kill()
    time.sleep(fault.seconds)
    drill.stack.restart_service("ckptd")
    return "ckptd", f"SIGKILL with an upload in flight, restarted {fault.seconds}s later"


def stop_s3(drill: Drill, fault: Fault) -> tuple[str, str]:
    assert drill.stack.s3 is not None
    drill.stack.s3.stop()
    time.sleep(fault.seconds)
    drill.stack.s3.start()
    return "s3", f"stopped for {fault.seconds}s"


def corrupt_shard(drill: Drill, fault: Fault) -> tuple[str, str]:
    attempts = drill.tap.attempts
    rank, pid = drill.victim(fault)
    # Frozen, the job saves nothing newer and restarts nothing before the damage is done (an
    # in-job restart would resume within a second).
    frozen = list(drill.job.rank_pids().values()) if drill.job is not None else [pid]
    for other in frozen:
        os.kill(other, signal.SIGSTOP)
    try:
        # The checkpoint the job will resume from, once S3 holds the good copy to fall back on.
        on_s3 = wait_on_s3(drill.stack.ckptd_address, drill.run_id, security=drill.security)
        latest = committed_on(on_s3)
        step = max(c.ref.step for c in latest)
        # node0's first shard: rank 0's, which node0's ranks wrote.
        shard = min((ssd_dir(drill.stack.workdir) / drill.run_id / str(step)).glob("__*.distcp"))
        with shard.open("r+b") as f:
            f.seek(shard.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        drill.stack.service("ckptd").kill()
        drill.stack.restart_service("ckptd")
        # The ranks' own copies of their last step would spare the restore any read of ckptd.
        from trainer.checkpoint.own_copy import remove_copies  # it loads torch; chaos not

        remove_copies(drill.run_id)
    finally:
        os.kill(pid, signal.SIGKILL)
        for other in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(other, signal.SIGCONT)
    detail = (
        f"damaged {shard.name} of step {step} on SSD, ckptd restarted, the ranks' own "
        f"copies dropped, rank {rank} killed"
    )
    return "ssd", detail + drill.await_restart(attempts)


def kill_telemetry(drill: Drill, fault: Fault) -> tuple[str, str]:
    drill.stack.service("telemetry").kill()
    time.sleep(fault.seconds)
    drill.stack.restart_service("telemetry")
    return "telemetry", f"SIGKILL, restarted {fault.seconds}s later"


def sdc(drill: Drill, fault: Fault) -> tuple[str, str]:
    rank = drill.rank_for(fault)
    return f"rank {rank}", f"a gradient bit flipped in step {fault.step} (--inject-sdc)"


def sdc_flags(fault: Fault, rank: int) -> list[str]:
    """The trainer's flags that make it strike sdc itself (`FaultKind.trainer_args`)."""
    return ["--inject-sdc", f"step={fault.step},rank={rank}"]


def kill_rendezvous(drill: Drill, fault: Fault) -> tuple[str, str]:
    attempts = drill.tap.attempts
    drill.stack.service(RENDEZVOUS).kill()
    return RENDEZVOUS, "SIGKILL" + drill.await_restart(attempts)


def partition_node(drill: Drill, fault: Fault) -> tuple[str, str]:
    node = drill.node_for(fault)
    ckptd = drill.stack.service(ckptd_service(node))
    ckptd.signal(signal.SIGSTOP)
    try:
        time.sleep(fault.seconds)
    finally:
        ckptd.signal(signal.SIGCONT)
    return node_name(node), f"ckptd frozen (SIGSTOP) for {fault.seconds}s, then SIGCONT"
