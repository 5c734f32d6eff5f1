"""torchrun for the embedded stack's machines and the Helm chart's pods: `torch.distributed.run`
with warm ranks, less one torch 2.13 crash.

Warm ranks. torchrun starts a rank named by a module (`-m trainer`) as a new interpreter, which
imports the trainer again at every start and every restart (5.4 s of wall time per rank here).
For `-m trainer` this agent hands torchrun the rank as a function instead (`trainer.warm.worker`)
with the `forkserver` start method, torchrun's own way to start function workers: one process per
agent imports the trainer once, from the moment the agent starts (so a spare waiting in the
rendezvous is warm before it is needed), and every rank of every attempt is forked from it.
`--start-method spawn` given explicitly (or `PET_START_METHOD=spawn`) keeps the new interpreter
per rank, as torchrun does; so does any other entry point.

The crash. When a job ends while an agent waits in the rendezvous' redundancy list (a hot spare
that was never needed), the rendezvous closes, torch's agent returns no result, and torchrun then
fails on it (`AttributeError: 'NoneType' object has no attribute 'is_failed'` in `launch_agent`)
and exits 1 with a traceback. That is the normal end of an unused spare: it says so in one line
and exits 0. Anything else torchrun raises is left as it is.

Cordoning (`--cordon-after N`, before torchrun's own options; the Helm chart's
`trainer.cordon.after`). The machine's keepers append their ranks' failures to a file of this
agent's (`scaletrain.cordon`); once N come in a row, the agent marks its Kubernetes node
unschedulable where the pod may (`trainer.cordon.markNode`), stops its ranks and exits
CORDONED_EXIT_CODE: a spare waiting in the rendezvous takes its place in the next round, and the
pod's replacement is scheduled on another node. The embedded stack cordons from outside its
agents instead (`scaletrain.app.stack.Job`), where it knows whether a spare waits.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scaletrain.app.growth import FLAP_WINDOW_S, GrowthRecord
from scaletrain.cordon import (
    CORDONED_EXIT_CODE,
    FAILURES_ENV,
    FailureWatch,
    KubeNode,
    cordon_node,
)
from scaletrain.errors import UserError
from scaletrain.process import descendants

# The module whose ranks are forked warm.
WARM_MODULE = "trainer"
WARM_START = "forkserver"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import run
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousTimeoutError,
    )

    argv = sys.argv[1:] if argv is None else argv
    try:
        cordon_after, argv = own_options(argv)
    except UserError as exc:
        print(f"agent: error: {exc}", file=sys.stderr)
        return 2
    args = run.parse_args(argv)
    if cordon_after:
        _watch_failures(cordon_after)
    if elastic(args):
        restart_on_lost_nodes()
    try:
        if warm(args, argv):
            _launch_warm(args)
        else:
            run.run(args)
    except AttributeError as exc:
        if "is_failed" not in str(exc):
            raise
        print("[agent] the job ended while this machine waited as a spare", flush=True)
    except RendezvousClosedError:
        # A machine that came back (or was added) to an elastic job after it had ended, or one
        # waiting for capacity beside a machine that stopped waiting first.
        print(
            "[agent] the job had ended (its rendezvous closed) as this machine met it", flush=True
        )
    except RendezvousTimeoutError:
        low = str(args.nnodes).partition(":")[0]
        print(
            f"[agent] no round of at least {low} machine(s) formed within the rendezvous' "
            f"join_timeout ({join_timeout(args.rdzv_conf):g}s; scaletrain's --capacity-wait-s): "
            "this machine stops; the job resumes from its newest committed checkpoint when "
            "started again",
            flush=True,
        )
        return 1
    return 0


def join_timeout(rdzv_conf: str) -> float:
    """The rendezvous' join_timeout in `--rdzv-conf` (torchrun's default where not given)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    for item in filter(None, rdzv_conf.split(",")):
        key, _, value = item.partition("=")
        if key.strip() == "join_timeout":
            return float(value)
    return RendezvousTimeout().join.total_seconds()


def own_options(argv: list[str]) -> tuple[int, list[str]]:
    """`--cordon-after N` at the front of `argv` (0 without it), and torchrun's arguments after
    it: only at the front, so that no option of the training script is taken for it."""
    if argv[:1] == ["--cordon-after"] and len(argv) > 1:
        value, rest = argv[1], argv[2:]
    elif argv[:1] and argv[0].startswith("--cordon-after="):
        value, rest = argv[0].split("=", 1)[1], argv[1:]
    else:
        return 0, argv
    if not value.isdigit():
        raise UserError(f"--cordon-after must be a whole number of failures, got {value!r}")
    return int(value), rest


def _watch_failures(after: int) -> None:
    """Tell this machine's keepers where to record their ranks' failures (the environment the
    ranks are started with), and cordon the machine once `after` come in a row."""
    path = Path(tempfile.gettempdir()) / f"scaletrain-agent-{os.getpid()}" / "failures"
    os.environ[FAILURES_ENV] = str(path)
    FailureWatch(path, after, _cordon).start()


def _cordon(why: str) -> None:
    """Take this machine out of the job: its node marked unschedulable, its ranks stopped, the
    agent gone with CORDONED_EXIT_CODE (a waiting spare takes its place in the next round)."""
    marked = cordon_node(KubeNode.in_cluster())
    print(
        f"[agent] this machine is cordoned: {why}; {marked}; its ranks are stopped and it "
        f"leaves the job (exit {CORDONED_EXIT_CODE})",
        flush=True,
    )
    for pid in descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    os._exit(CORDONED_EXIT_CODE)


def elastic(args: argparse.Namespace) -> bool:
    """Whether the job may run on fewer nodes than its most (`--nnodes MIN:MAX`, MIN < MAX)."""
    low, _, high = str(args.nnodes).partition(":")
    return bool(high) and int(low) < int(high)


def restart_on_lost_nodes() -> None:
    """Make torch's c10d rendezvous count a node lost from the running round as a membership
    change, as it counts a node waiting to join: the agents then stop their workers and meet
    again, on the nodes that remain, without spending one of their restarts; and hold a node
    waiting to join back while the job is flapping (`scaletrain.app.growth`).

    What torch 2.13 lacks. Its agent restarts its workers on a membership change only when a
    node waits to join (`num_nodes_waiting`). A node lost while the job runs is dropped from the
    round's participants once its heartbeat is keep_alive_interval x keep_alive_max_attempt old,
    but nothing acts on that: the survivors' ranks fail on their next collective, their keepers
    wait out the generation's join time (trainer.keeper.JOIN_S, 10 s) and the agents restart
    them as a failure, one of --max-restarts. Here the round remembers how many nodes formed it,
    and fewer live participants in a round that is not closed (an agent that finished closes
    it) read as nodes waiting: the agents re-form the job at once."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    handler = dynamic_rendezvous.DynamicRendezvousHandler
    if getattr(handler, "_scaletrain_patched", False):
        return
    next_rendezvous, num_nodes_waiting = handler.next_rendezvous, handler.num_nodes_waiting

    def formed(self: Any) -> Any:
        info = next_rendezvous(self)
        self._scaletrain_formed = info.world_size
        self._scaletrain_growth = GrowthRecord(self._store, self._settings.run_id)
        growth = self._scaletrain_growth.formed(self._state_holder.state.round, info.world_size)
        self._scaletrain_growth_now, self._scaletrain_read_at = growth, time.time()
        self._scaletrain_held = 0.0
        return info

    def waiting(self: Any) -> int:
        count = num_nodes_waiting(self)  # syncs the state, dead nodes dropped
        state = self._state_holder.state
        if state.closed or not state.complete:
            return count
        lost = getattr(self, "_scaletrain_formed", 0) - len(state.participants)
        if lost > 0:
            return lost  # never held back: the job cannot train on without re-forming
        if count and _held_back(self, count):
            return 0
        return count

    handler.next_rendezvous, handler.num_nodes_waiting = formed, waiting
    handler._scaletrain_patched = True


def _held_back(handler: Any, waiting: int) -> bool:
    """Whether the machines waiting to join are held back (the job flapping), saying so once
    per hold; the record is read at most once a second (the agent asks ten times a second)."""
    now = time.time()
    if now - handler._scaletrain_read_at >= 1.0:
        handler._scaletrain_read_at = now
        handler._scaletrain_growth_now = handler._scaletrain_growth.read()[0]
    growth = handler._scaletrain_growth_now
    grows_in = growth.grows_in(now)
    if grows_in <= 0:
        return False
    if handler._scaletrain_held != growth.hold_s:
        handler._scaletrain_held = growth.hold_s
        print(
            f"[agent] {waiting} machine(s) wait to join; the job lost a machine within "
            f"{FLAP_WINDOW_S:g}s of its last grow (flapping): it grows in {grows_in:.0f}s, "
            f"{growth.hold_s:g}s after it last re-formed, not at once",
            flush=True,
        )
    return True


def warm(args: argparse.Namespace, argv: list[str]) -> bool:
    """Whether the ranks are forked warm: the trainer's module, and no start method asked for
    other than the forkserver."""
    asked = any(a.split("=")[0] in ("--start-method", "--start_method") for a in argv)
    asked = asked or "PET_START_METHOD" in os.environ
    return bool(
        args.module
        and args.training_script == WARM_MODULE
        and not args.no_python
        and not args.standalone
        and args.rdzv_backend == "c10d"
        and (not asked or args.start_method == WARM_START)
    )


def _launch_warm(args: argparse.Namespace) -> None:
    """torchrun's launch, each rank `trainer.warm.worker(*script args)` forked from a forkserver
    that imports the trainer from now on."""
    import multiprocessing
    from multiprocessing import forkserver

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    from trainer.warm import PRELOAD, worker

    if args.master_port is None:  # as torchrun's run() sets it (only the static backend reads it)
        args.master_port = 29500
    config, _cmd, _cmd_args = config_from_args(args)
    config.start_method = WARM_START
    # The ranks print as `python -u` would have them: unbuffered.
    os.environ["PYTHONUNBUFFERED"] = "1"
    multiprocessing.get_context(WARM_START).set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()  # starts importing now, while the agent meets its peers
    elastic_launch(config=config, entrypoint=worker)(*args.training_script_args)


if __name__ == "__main__":
    sys.exit(main())
