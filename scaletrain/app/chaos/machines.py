"""The strikes that take a whole machine (a node of the job): kill-node and its kinds, the node
that comes back, the node that fails until it is cordoned, the machine that corrupts until it is
quarantined.

Each strike takes the drill and its fault and returns (its target, what happened), as
`FaultKind.inject` says. A node's machine is lost once no committed checkpoint needs it (or, for
kill-node-mid-save, in the instant one does), and comes back empty at its address or as a spare.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ckptd.states import TIER_COMMITTED
from scaletrain.app.chaos.watch import WAIT_S, JobEnded, committed_on
from scaletrain.app.embedded import flag_value
from scaletrain.app.stack import ckptd_service, node_name
from scaletrain.errors import ScaletrainError, UserError
from scaletrain.v1 import checkpoint_pb2, common_pb2

if TYPE_CHECKING:
    from scaletrain.app.chaos.drill import Drill
    from scaletrain.app.chaos.faults import Fault

# How long a node's ckptd, frozen, leaves a commit that its vote already reached to land.
_COMMIT_SETTLE_S = 1.0
# How fast every ckptd copies parts to peers while kill-node-mid-save waits for its strike (MB/s);
# the rate they had comes back once the node is lost.
MID_SAVE_REPLICA_MB_S = 2


def kill_node(drill: Drill, fault: Fault) -> tuple[str, str]:
    node, held, attempts, serving = _freeze_and_kill(drill, fault)
    return _lose_node(drill, node, held, attempts, serving)


def lose_node_for_good(drill: Drill, fault: Fault) -> tuple[str, str]:
    """kill-node with no machine in its place: a spare if one waits, else the elastic job re-forms
    on the nodes that remain (`Job._shrink`)."""
    assert drill.job is not None
    spare = bool(drill.options.spares)
    node, held, attempts, serving = _freeze_and_kill(drill, fault, replaced=spare)
    if spare:
        return _lose_node(drill, node, held, attempts, serving)
    left = len(serving - {node})
    lost = (
        f"agent, ranks and ckptd SIGKILLed ({held}), data dir deleted; no machine takes its place"
    )
    if left < drill.options.min_nodes:
        # The job cannot train until a machine joins: the next fault (a return-node) strikes as
        # soon as the stack has taken the loss in, not at its step.
        drill.tap.wait(lambda: drill.done.is_set() or node in drill.job.left)  # type: ignore[union-attr]
        return node_name(node), (
            f"{lost}: {left} node(s) left, fewer than {drill.options.min_nodes}; the job waits "
            f"up to {drill.options.capacity_wait_s:g}s for a machine to join"
        )
    return node_name(node), f"{lost}: the job re-forms on {left} node(s)" + (
        drill.await_restart(attempts)
    )


def return_node(drill: Drill, fault: Fault) -> tuple[str, str]:
    """A machine lost for good comes back (a fresh one at its address): the elastic job takes it
    in at its next rendezvous round and grows."""
    assert drill.job is not None
    attempts = drill.tap.attempts
    if not drill.job.left:
        return "none", "no node had been lost for good: nothing came back"
    node = min(drill.job.left)
    learned = _fresh_machine(drill, node)
    grown = len(drill.job.serving() | {node})
    return node_name(node), (
        f"a fresh machine at {drill.stack.ckptd_addresses[node]} {learned}; the job grows to "
        f"{grown} node(s)" + drill.await_restart(attempts)
    )


def kill_node_mid_save(drill: Drill, fault: Fault) -> tuple[str, str]:
    """Lose a node in the instant after a save committed, before its part has its copies: the
    step may go with it, and the job must resume from the newest step it can restore (never
    start over). A step lost so was never node-loss safe (`lost_with_node`)."""
    assert drill.job is not None
    if drill.options.spares:
        _wait_for_spare(drill)
    attempts, serving = drill.tap.attempts, drill.job.serving()
    node = _node_to_kill(drill, fault, serving)
    # Copies slow enough that "committed, its part not yet on a peer" lasts seconds, until the
    # strike: the recovery and the rest of the drill copy at the usual rate.
    with _replica_rate(drill, MID_SAVE_REPLICA_MB_S * (1 << 20)):
        before = max(_committed_steps(drill) or {0})
        deadline = time.monotonic() + WAIT_S
        while not drill.done.is_set() and time.monotonic() < deadline:
            steps = _committed_steps(drill) or set()
            if steps and max(steps) > before:
                break
            time.sleep(0.02)
        else:
            raise JobEnded
        newest = max(steps)
        if newest >= drill.options.steps:  # the job's last save: it ends, nothing to recover
            raise JobEnded
        drill.struck_step = drill.tap.step
        state = "already node-loss safe"
        with contextlib.suppress(ScaletrainError), drill.ckptd() as c:
            info = c.get(drill.run_id, newest)
            on_s3 = common_pb2.TIER_S3 in {t.tier for t in info.tiers if t.state == TIER_COMMITTED}
            if not info.node_loss_safe and on_s3:
                # Its upload outran its copy: the lost part's only other home is S3.
                state = "not yet node-loss safe but already on S3"
            elif not info.node_loss_safe:
                drill.lost_with_node.add(newest)
                state = "not yet node-loss safe"
        _kill_machine(drill, node)
    return _lose_node(drill, node, f"step {newest} committed, {state}", attempts, serving)


def kill_spare_taking_over(drill: Drill, fault: Fault) -> tuple[str, str]:
    """kill-node, and the spare that takes the lost node's place too, as soon as it runs ranks,
    before the job trains on it: the job must find it lost and go on with the next machine (the
    first lost one, coming back)."""
    waiting = _wait_for_spare(drill)  # a spare must be there to lose
    struck: list[str] = []

    def strike_the_spare() -> None:
        deadline = time.monotonic() + WAIT_S
        while not drill.done.is_set() and time.monotonic() < deadline:
            taking = sorted(waiting & drill.job.serving())  # type: ignore[union-attr]
            if taking:
                _kill_machine(drill, taking[0], replaced=False)
                struck.append(node_name(taking[0]))
                _spare_machine(drill, taking[0])  # it comes back later, as a spare
                return
            time.sleep(0.05)

    striker = threading.Thread(target=strike_the_spare, name="chaos-spare", daemon=True)
    striker.start()
    target, detail = kill_node(drill, fault)
    striker.join(WAIT_S)
    spare = struck[0] if struck else "NONE"
    return target, f"{detail}; then the spare {spare} lost as it took over"


def flaky_node(drill: Drill, fault: Fault) -> tuple[str, str]:
    """Kill a rank of one node, again each time the job trains after its restart, until the stack
    cordons the node (`Job._count_failure`) and a spare takes its place."""
    assert drill.job is not None
    serving = drill.job.serving()
    node = _node_to_kill(drill, fault, serving)
    kills, deadline = 0, time.monotonic() + WAIT_S
    while node not in drill.job.cordoned:
        pids = drill.job.rank_pids(node)
        if drill.done.is_set() or time.monotonic() > deadline:
            raise JobEnded
        if not pids:  # its ranks are being forked again
            time.sleep(0.05)
            continue
        attempts, mark = drill.tap.attempts, drill.tap.mark()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[min(pids)], signal.SIGKILL)
            kills += 1
        drill.tap.wait(lambda a=attempts, m=mark: _trains_again(drill, node, a, m))
    attempts = drill.tap.attempts
    restarted = drill.await_restart(attempts)
    drill.spare_used = ", ".join(map(node_name, sorted(drill.job.serving() - serving)))
    return node_name(node), (
        f"a rank of it SIGKILLed {kills} times; cordoned, spare "
        f"{drill.spare_used or 'NONE'} took its place{restarted}"
    )


# Steps between corrupting-rank's two flips.
CORRUPT_AGAIN_AFTER = 2


def corrupting_rank_flags(fault: Fault, rank: int) -> list[str]:
    """The trainer's flags that flip a bit of rank `rank`'s gradients in steps STEP and
    STEP + CORRUPT_AGAIN_AFTER (`FaultKind.trainer_args`)."""
    steps = (fault.step, fault.step + CORRUPT_AGAIN_AFTER)
    return [arg for step in steps for arg in ("--inject-sdc", f"step={step},rank={rank}")]


def corrupting_rank(drill: Drill, fault: Fault) -> tuple[str, str]:
    """The trainer flips the bits itself (`corrupting_rank_flags`); here the drill waits for the
    second finding to quarantine the rank, its machine to be cordoned (`Job._quarantine`) and
    the job to restart with the spare in its place."""
    job = drill.job
    assert job is not None
    rank, serving, attempts = drill.rank_for(fault), job.serving(), drill.tap.attempts
    node = next((n for n in serving if rank in job.rank_pids(n)), None)
    if node is None or not drill.tap.wait(lambda: drill.done.is_set() or node in job.cordoned):
        raise JobEnded
    restarted = drill.await_restart(attempts)
    drill.spare_used = ", ".join(map(node_name, sorted(job.serving() - serving)))
    return f"rank {rank}", (
        f"a gradient bit flipped in steps {fault.step} and {fault.step + CORRUPT_AGAIN_AFTER} "
        f"(--inject-sdc); quarantined, {node_name(node)} cordoned, spare "
        f"{drill.spare_used or 'NONE'} took its place{restarted}"
    )


def _trains_again(drill: Drill, node: int, attempts: int, mark: int) -> bool:
    """Whether the job trained again since `mark` in an attempt after `attempts`, or ended, or
    cordoned `node`."""
    assert drill.job is not None
    again = drill.tap.attempts > attempts and drill.tap.seen_since(mark, "[trainer] step ")
    return again or drill.done.is_set() or node in drill.job.cordoned


def _freeze_and_kill(
    drill: Drill, fault: Fault, replaced: bool = True
) -> tuple[int, str, int, set[int]]:
    """Kill a node (`_node_to_kill`) once no committed checkpoint needs it: (the node, what held
    the checkpoints then, the attempts and the serving nodes before it)."""
    assert drill.job is not None
    if drill.options.spares:
        _wait_for_spare(drill)
    attempts, serving = drill.tap.attempts, drill.job.serving()
    node = _node_to_kill(drill, fault, serving)
    ckptd = drill.stack.service(ckptd_service(node))
    # The job must have a checkpoint to resume from before its ranks are frozen; with replicas,
    # one on 2 nodes (copied in the background after its commit). Not the newest: on a loaded
    # machine a copy can take longer than the steps between two saves, and the newest is then
    # never safe while the job trains; frozen, it catches up (below).
    _wait_committed(drill, bool, time.monotonic() + WAIT_S)
    if flag_value(drill.options.trainer_args, "--replicas") != "1":
        _wait_committed(drill, _some_node_loss_safe, time.monotonic() + WAIT_S)
    if drill.done.is_set():
        raise JobEnded
    # Frozen, the node's ranks can complete no save, so no checkpoint commits with a part that
    # only this machine holds; its ckptd goes on uploading to S3, and copying its part to its
    # peers, until every committed checkpoint is on S3 or on 2 nodes.
    frozen = drill.job.machine_pids(node)
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError):  # it ended: nothing to freeze
            os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + WAIT_S
    while True:
        # Checked while the node's ckptd answers: node0 asks it for its part's copies.
        on_s3 = _wait_committed(drill, _all_safe, deadline)
        before = _committed_steps(drill)
        ckptd.signal(signal.SIGSTOP)  # a commit in flight needs its vote: none from now on
        if drill.done.is_set():
            ckptd.signal(signal.SIGCONT)
            for pid in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            raise JobEnded
        # A commit whose vote left before the freeze may still land: give it a moment, then check
        # again with the node thawed. node0 lists its own catalog here, never asking the frozen
        # node (that call would wait out the peer timeout every time round).
        time.sleep(_COMMIT_SETTLE_S)
        if not on_s3 or (before is not None and _committed_steps(drill) == before):
            break
        ckptd.signal(signal.SIGCONT)
    held = (
        "every committed checkpoint was on S3 or on 2 nodes"
        if on_s3
        else "a committed checkpoint was NEITHER on S3 NOR on 2 nodes"
    )
    _kill_machine(drill, node, replaced)
    return node, held, attempts, serving


@contextlib.contextmanager
def _replica_rate(drill: Drill, bytes_s: float) -> Iterator[None]:
    """Every ckptd copies parts to its peers at `bytes_s` for the span (ckptd's SetReplicaRate);
    each that still answers gets its own rate back after it."""
    before: dict[str, float] = {}
    for address in drill.stack.ckptd_addresses:
        with contextlib.suppress(ScaletrainError), drill.ckptd(address) as client:
            before[address] = client.set_replica_rate(bytes_s)
    try:
        yield
    finally:
        for address, rate in before.items():
            with contextlib.suppress(ScaletrainError), drill.ckptd(address) as client:
                client.set_replica_rate(rate)


def _wait_for_spare(drill: Drill) -> set[int]:
    """The spares waiting in the rendezvous, once there is one (a machine lost earlier comes back
    as one in seconds): a node fault of a drill with --spares strikes the spare path."""
    assert drill.job is not None
    deadline = time.monotonic() + WAIT_S
    while not (waiting := set(drill.job.waiting_spares())):
        if drill.done.is_set() or time.monotonic() > deadline:
            raise JobEnded
        time.sleep(0.2)
    return waiting


def _node_to_kill(drill: Drill, fault: Fault, serving: set[int]) -> int:
    """A node picked by the seed: never node0 (whose ckptd the drill and the summary ask); with
    spares, one that runs ranks now (a spare may have taken a node's place). The machine an
    earlier kill lost may still be coming back: until it is, the job waits for it as for a
    replaced machine. An elastic job's machine lost for good is never picked again."""
    assert drill.job is not None
    nodes = sorted(serving - {0}) if drill.options.spares else []
    if drill.job.left:
        nodes = sorted((set(nodes) or set(range(1, drill.options.nodes))) - drill.job.left)
    if not nodes:
        return drill.node_for(fault, first=1)
    return nodes[drill.random_for(fault).randrange(len(nodes))]


def _kill_machine(drill: Drill, node: int, replaced: bool = True) -> None:
    """SIGKILL node `node`'s agent, ranks and ckptd and delete its data dir (its SSD); the job is
    told it is being `replaced`, or finds out itself."""
    assert drill.job is not None
    drill.struck_step = drill.struck_step or drill.tap.step
    if replaced:
        drill.job.kill_agent(node)
    else:
        drill.job.lose(node)
    drill.stack.service(ckptd_service(node)).kill()
    data_dir = drill.stack.workdir.ckptd_dir(node)
    shutil.rmtree(data_dir)
    data_dir.mkdir()


def _lose_node(
    drill: Drill, node: int, held: str, attempts: int, serving: set[int]
) -> tuple[str, str]:
    """After `_kill_machine(node)`: a spare takes its place, or the machine comes back empty at
    the same address."""
    assert drill.job is not None
    name, address = node_name(node), drill.stack.ckptd_addresses[node]
    killed = f"agent, ranks and ckptd SIGKILLed ({held}), data dir deleted"
    if drill.options.spares:
        # A warm spare takes the node's place in the next round: the job goes on without waiting
        # for a new machine, which joins as the next spare while the drill goes on.
        restarted = drill.await_restart(attempts)
        drill.spare_used = ", ".join(map(node_name, sorted(drill.job.serving() - serving)))
        threading.Thread(
            target=_spare_machine, args=(drill, node), name="chaos-fresh-machine", daemon=True
        ).start()
        return name, (
            f"{killed}; spare {drill.spare_used or 'NONE'} took its place; a fresh machine "
            f"comes up at {address} as the next spare{restarted}"
        )
    drill.fresh_at = time.time()
    detail = f"{killed}; a fresh ckptd at {address} {_fresh_machine(drill, node)}, agent "
    return name, detail + "started again" + drill.await_restart(attempts)


def _fresh_machine(drill: Drill, node: int) -> str:
    """Start node `node` again as a new machine: its ckptd with the empty data dir, once it has
    learned the newest checkpoint, then its agent. Returns what the ckptd learned."""
    assert drill.job is not None
    drill.stack.restart_service(ckptd_service(node))
    learned = _wait_knows_newest(drill, drill.stack.ckptd_addresses[node])
    if not drill.job.start_agent(node):
        raise JobEnded
    return learned


def _spare_machine(drill: Drill, node: int) -> None:
    """A new machine in node `node`'s place, as the next spare (a thread of its own)."""
    with contextlib.suppress(JobEnded, ScaletrainError, UserError):
        learned = _fresh_machine(drill, node)
        drill.tap.write(f"[chaos] a fresh machine {node_name(node)} {learned}, the next spare\n")


def _wait_committed(
    drill: Drill,
    enough: Callable[[list[checkpoint_pb2.CheckpointInfo]], bool],
    deadline: float = 0,
) -> bool:
    """Whether the run's committed checkpoints are `enough` (given node0's view of them), waiting
    for it until `deadline` (time.monotonic(); 0: asks once)."""
    while True:
        with contextlib.suppress(ScaletrainError), drill.ckptd() as c:
            if enough(committed_on(c.list(drill.run_id, nodes=True))):
                return True
        if drill.done.is_set() or time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def _committed_steps(drill: Drill, address: str = "") -> set[int] | None:
    """The steps the ckptd at `address` (node0's if empty) lists as committed in its own catalog,
    asking no peer (None: it did not answer)."""
    address = address or drill.stack.ckptd_address
    with contextlib.suppress(ScaletrainError), drill.ckptd(address) as c:
        return {info.ref.step for info in committed_on(c.list(drill.run_id))}
    return None


def _wait_knows_newest(drill: Drill, address: str) -> str:
    """Wait until the ckptd at `address` lists node0's newest committed checkpoint that can be
    restored (one lost with a node mid-save is committed, but gone)."""
    deadline = time.monotonic() + WAIT_S
    newest = -1
    with contextlib.suppress(ScaletrainError), drill.ckptd() as c:
        newest = c.get(drill.run_id).ref.step
    while time.monotonic() < deadline and not drill.done.is_set():
        if newest in (_committed_steps(drill, address) or ()):
            return f"lists step {newest}"
        time.sleep(0.2)
    return f"does not list step {newest}"


def _some_node_loss_safe(committed: list[checkpoint_pb2.CheckpointInfo]) -> bool:
    """Whether one of the `committed` checkpoints has every part on 2 nodes."""
    return any(c.node_loss_safe for c in committed)


def _all_safe(committed: list[checkpoint_pb2.CheckpointInfo]) -> bool:
    """Whether each of the `committed` checkpoints (there is one) survives the loss of any one
    node: S3 holds it whole, or it is node-loss safe (each part on 2 nodes)."""
    on_s3 = committed_on(committed, common_pb2.TIER_S3)
    return bool(committed) and all(c in on_s3 or c.node_loss_safe for c in committed)
