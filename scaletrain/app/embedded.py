"""`scaletrain run`: the whole platform on one machine, then a summary of what happened.

Starts the embedded stack (one or more simulated nodes), trains under torchrun, waits until the
last checkpoint has reached every tier on every node, stops everything, and reads the summary back
(`scaletrain.app.summary`) from telemetry's database and node0's ckptd (which asks its peers for
their parts).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from ckptd.client import CkptdClient
from ckptd.datadir import list_offline
from scaletrain.app.rendezvous import CAPACITY_WAIT_S
from scaletrain.app.stack import Stack, Workdir, check_nodes
from scaletrain.app.summary import RunSummary, checkpoint_row, summarize, whole_tiers
from scaletrain.cordon import CORDON_AFTER
from scaletrain.errors import UserError
from scaletrain.names import TIER_NAMES
from scaletrain.security import ClientSecurity, Role
from scaletrain.v1 import checkpoint_pb2, common_pb2


@dataclass(frozen=True)
class RunOptions:
    workdir: Workdir
    ranks: int = 4
    # Simulated nodes on loopback, each with its own ckptd and torchrun agent (ranks split evenly).
    nodes: int = 1
    # Elastic below `nodes` (0: not): the job goes on with as few when no spare is left.
    min_nodes: int = 0
    # Elastic, fewer than `min_nodes` left: how long the job waits for a machine to join.
    capacity_wait_s: float = CAPACITY_WAIT_S
    # Hot spare machines beside them, warm, each taking a lost node's place.
    spares: int = 0
    # With spares, a node whose ranks failed this many times is cordoned (0: never).
    cordon_after: int = CORDON_AFTER
    steps: int = 300
    ckpt_every: int = 100
    run_id: str | None = None
    resume: bool = False
    trainer_args: list[str] = field(default_factory=list)
    # How many times torchrun may restart the job after a rank failed (each resumes from the
    # latest committed checkpoint).
    max_restarts: int = 0
    # How long to wait, after training, for the last checkpoint to reach S3.
    upload_wait_s: float = 120.0
    # TLS between every part, and tokens: the trainer's may write only this run.
    secure: bool = False


def new_run_id() -> str:
    return datetime.now(UTC).strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def run(options: RunOptions, out: IO[str]) -> RunSummary:
    if options.ranks < 1:
        raise UserError(f"--ranks must be at least 1, got {options.ranks}")
    if options.max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more, got {options.max_restarts}")
    workdir = options.workdir
    run_id = options.run_id or (workdir.last_run_id() if options.resume else None) or new_run_id()
    if options.resume and not workdir.last_run_id() and not options.run_id:
        raise UserError(f"--resume: no earlier run in {workdir.root}; start one without --resume")
    check_nodes(options.ranks, options.nodes, options.spares, min_nodes=options.min_nodes)
    check_sizes(options.trainer_args, options.ranks, options.nodes, options.min_nodes)
    started = time.monotonic()
    trainer_args = [
        "--steps", str(options.steps), "--ckpt-every", str(options.ckpt_every),
        *(["--resume"] if options.resume else []),
        *options.trainer_args,
    ]  # fmt: skip
    saved_before = _newest_step(workdir, run_id)
    with Stack(
        workdir,
        secure=options.secure,
        nodes=options.nodes,
        spares=options.spares,
        cordon_after=options.cordon_after,
        min_nodes=options.min_nodes,
        capacity_wait_s=options.capacity_wait_s,
    ) as stack:
        workdir.remember_run(run_id)
        nodes = (
            f" ({options.nodes} nodes of {options.ranks // options.nodes} ranks)"
            if options.nodes > 1
            else ""
        )
        print(
            f"[scaletrain] run {run_id}: ckptd {' '.join(stack.ckptd_addresses)}, telemetry "
            f"{stack.telemetry_address}, logs in {workdir.logs}{nodes}",
            file=out,
            flush=True,
        )
        # Minted now, not after training: ckptd re-reads its tokens file at most once a second,
        # and a token minted in the instant before the summary's listing was still unknown to it.
        reader = stack.client_security(Role.READER, run_id)
        code = stack.train(run_id, options.ranks, trainer_args, out, options.max_restarts)
        if code != 0:
            logs = [workdir.trainer_log(node) for node in range(options.nodes)]
            raise UserError(
                f"training failed (exit code {code}): {_first_error(logs)}; "
                f"see {', '.join(map(str, logs))}"
            )
        copies = options.nodes > 1 and flag_value(options.trainer_args, "--replicas") != "1"
        checkpoints = _wait_for_tiers(
            stack.ckptd_address, run_id, options.upload_wait_s, saved_before, reader, copies
        )
    return summarize(workdir, run_id, checkpoints, time.monotonic() - started)


def _s3_settled(info: checkpoint_pb2.CheckpointInfo) -> bool:
    """Whether S3 is done with the checkpoint on every node: each node has recorded S3's copy (a
    node applies its retention in the same step, so its other tiers are settled too), or no node
    is making one (a step the run's `s3_every` leaves off S3)."""
    states = [
        t.state
        for holder in (info, *(p for p in info.parts if p.files))
        for t in holder.tiers
        if t.tier == common_pb2.TIER_S3
    ]
    committed = checkpoint_pb2.TIER_STATE_COMMITTED
    in_flight = (checkpoint_pb2.TIER_STATE_PENDING, checkpoint_pb2.TIER_STATE_FAILED)
    return all(s == committed for s in states) or not any(s in in_flight for s in states)


def _retention_settled(newest: checkpoint_pb2.CheckpointInfo) -> bool:
    """Whether the newest checkpoint is node-loss safe and every node knows it: a node's SSD
    keeps the newest safe step it knows of, so until then it may hold an older one that the
    policy lets go."""
    return newest.node_loss_safe and all(
        p.latest_safe_step == newest.ref.step for p in newest.parts if p.reachable
    )


def _first_error(logs: list[Path]) -> str:
    """The trainer's own one-line error, if a rank printed one, else what torchrun saw."""
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("trainer: ") and ": error: " in line:
                return line.removeprefix("trainer: ")
    return "a rank crashed or was killed"


def check_layout(trainer_args: list[str], ranks: int) -> None:
    """Refuse trainer options or a parallel layout that cannot run on `ranks` ranks.

    Runs the trainer's own checks in this process, so nothing is started for a bad layout.
    """
    from trainer.config import from_args, parser
    from trainer.parallel.dims import validate_layout

    # The launcher hands the trainer its ckptd: checked as if given (--mem-ckpt-every needs one).
    given = ["--run-id", "check", "--ckptd", "launcher:0", *trainer_args]
    try:
        validate_layout(from_args(parser().parse_args(given)), ranks)
    except ValueError as exc:
        raise UserError(str(exc)) from exc


def check_sizes(trainer_args: list[str], ranks: int, nodes: int, min_nodes: int) -> None:
    """`check_layout` at every size the job may run at: `ranks` over `nodes` nodes, and as many
    per node on each smaller number down to `min_nodes` (elastic)."""
    per_node = ranks // nodes if nodes else ranks
    for size in range(nodes, (min_nodes or nodes) - 1, -1):
        try:
            check_layout(trainer_args, per_node * size)
        except UserError as exc:
            if size == nodes:
                raise
            raise UserError(
                f"--nodes {min_nodes}:{nodes}: on {size} node(s), {per_node * size} ranks: {exc}"
            ) from None


def flag_value(args: list[str], name: str) -> str | None:
    """The value of `name` in a command line (its last one), or None."""
    values = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == name]
    return values[-1] if values else None


def _newest_step(workdir: Workdir, run_id: str) -> int:
    """The step of the run's newest checkpoint in node0's catalog, read before its ckptd starts
    (0: none yet)."""
    if not (workdir.ckptd / "catalog.db").exists():
        return 0
    return max((c.ref.step for c in list_offline(workdir.ckptd, run_id)), default=0)


def _wait_for_tiers(
    address: str,
    run_id: str,
    timeout_s: float,
    saved_before: int = 0,
    security: ClientSecurity | None = None,
    copies: bool = False,
) -> list[checkpoint_pb2.CheckpointInfo]:
    """The run's checkpoints with every node's part, once what the run saved has settled (or
    the time is up): the newest committed on the durable tiers of every node (SSD, and S3 whole),
    with `copies` node-loss safe too and known so by every node, S3 done with every one it saved
    on every node, and two listings in a row alike. Not memory: the memory tier died with the
    ckptd that held it.

    The older ones matter because retention moves them only once S3 holds them (an SSD copy
    goes after the upload), and the uploads of one step wait for every node's part: a summary
    taken sooner shows tiers that are about to change.

    Only a checkpoint this run saved (newer than `saved_before`) is waited for: an older one
    has nothing in flight, and a run resumed on fewer nodes may never see it whole on SSD (the
    part of a node it does not run is on that node's disk), so waiting would only run out the
    clock."""
    deadline = time.monotonic() + timeout_s
    durable = {TIER_NAMES[common_pb2.TIER_SSD], TIER_NAMES[common_pb2.TIER_S3]}
    seen: list[dict] | None = None
    with CkptdClient(address, security) as client:
        while True:
            checkpoints = client.list(run_id, nodes=True)
            saved = [c for c in checkpoints if c.ref.step > saved_before]
            newest = max(saved, key=lambda c: c.ref.step, default=None)
            rows = [checkpoint_row(c) for c in checkpoints]
            if newest is None or (
                durable <= set(whole_tiers(newest))
                and (not copies or _retention_settled(newest))
                and all(_s3_settled(c) for c in saved)
                and rows == seen
            ):
                return checkpoints
            if time.monotonic() > deadline:
                return checkpoints
            seen = rows
            time.sleep(0.5)
