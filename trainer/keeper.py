"""In-job restart: a keeper process above each rank, so that a failed rank costs a fork, not a
restart of the job.

torchrun's agent answers any failed rank by stopping every rank on every node and starting them
again: a new interpreter per rank, and `import trainer.train` alone costs 5.4 s of wall time here
(4.4 s of CPU; four ranks share two cores). With `--in-job-restarts N` the process torchrun starts
is a keeper instead. It imports the trainer once, then forks the process that trains. When any
rank of the job fails (it died, its watchdog fired, a collective broke), every keeper stops its
rank and forks a fresh one into the next *generation*: the same rank and world size, a new process
group on a fresh prefix of the job's store, the model and state built again, and the job resumes
at the newest committed checkpoint (with `--mem-ckpt-every`, the newest step in ckptd's memory).
No interpreter starts and nothing is imported again: the fork has torch loaded.

Why not keep the survivors' processes and only rebuild their process groups: gloo cannot abort a
collective in flight. Measured with torch 2.13 (4 gloo ranks, a 2x2 mesh, rank 3 killed): the two
ranks that talked to rank 3 raised at once ("Read error", "Connection closed by peer"), while rank
0, blocked in an all-reduce with one of them, stayed blocked after `ProcessGroup.abort()` on
every group (it returns, and nothing wakes) until the collective timeout. A survivor that waits
on a survivor can only be freed by ending its process; NCCL's communicators can be aborted
(`ncclCommAbort`), which is where an in-process rebuild belongs.

The generations meet in the job's store (torchrun's agent store on one node; with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, a store hosted by rank 0's keeper, which outlives its
ranks). The first keeper that sees its rank fail marks the generation failed; every keeper
watches for that mark and stops its rank. A rank that ends in a one-line error (exit 1 or 2: a bad
config, a checkpoint that cannot be restored) ends the job attempt on every node instead: those
errors would repeat. After `N` in-job restarts a failure goes to torchrun's agent as before, which
restarts every rank cold (and a lost node is replaced there, by a spare when there is one).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from scaletrain.cordon import record_failure
from scaletrain.process import (
    PEER_LOST,
    RANK_PROCESS,
    STORE_PROCESS,
    die_with_parent,
    exit_now,
    name_process,
)

# The store prefix of the rank's process group, set by its keeper (absent: no keeper).
PREFIX_ENV = "SCALETRAIN_STORE_PREFIX"
# The rank's generation: 0 first, one more after each in-job restart.
GENERATION_ENV = "SCALETRAIN_GENERATION"
# Set for the rank forked after its keeper ended a frozen one: "STEP:SILENT_S", which the new
# rank reports to telemetry as the hang it was (the keeper has no telemetry client).
FROZEN_ENV = "SCALETRAIN_FROZEN"
# What a rank exits with on an error it has already reported in one line (trainer/__main__.py):
# the same error would come again, so the keepers end the attempt instead of restarting in-job.
FINAL_EXIT_CODES = (1, 2)
# What a rank exits with when an exception escaped the loop (a bug, any error but the next).
FAILED_EXIT_CODE = 70
# What a rank exits with when a collective failed: a peer died or hung up (`PEER_LOST`).
PEER_LOST_EXIT_CODE = 71
# How often a keeper looks at its rank and at the store.
POLL_S = 0.05
# How long a rank stopped by its keeper may hand telemetry its last records before SIGKILL.
STOP_GRACE_S = 0.5
# How long a keeper waits for the job's store (rank 0's keeper hosts it, maybe still starting).
STORE_TIMEOUT = timedelta(seconds=60)
# How long the first generation waits for every keeper (each imports the trainer first).
FIRST_JOIN_S = 300.0
# How long a later generation waits for every keeper: they are warm, and one that does not come
# went with its machine; torchrun's agents then re-form the job (with a spare, if any).
JOIN_S = 10.0
# A rank that shows no sign of life this long is frozen (SIGSTOP, a deadlock on the GIL, a
# process the kernel does not run): its keeper ends it, and the job restarts in-job at once
# instead of waiting out the watchdog's deadline on the ranks that wait for it. A live rank's
# watchdog thread signs every WATCH_TICK_S however long its step, so this judges the process,
# not the work (a rank hung in a collective or a kernel is still the watchdog's to find).
FROZEN_AFTER_S = 4.0
# Memory the rank shares with its keeper (a map made by the keeper before its forks): the last
# step it completed (where a failed rank got to, for the cordon's count), then its last sign of
# life (time.monotonic_ns, one clock for every process of the machine; 0: not judged).
_shared: mmap.mmap | None = None
_STEP, _ALIVE = slice(0, 8), slice(8, 16)


@dataclass(frozen=True)
class Generation:
    """One generation of the job's ranks, and its keys in the job's store."""

    index: int
    prefix: str

    @property
    def joined(self) -> str:
        return f"{self.prefix}/joined"

    @property
    def failed(self) -> str:
        return f"{self.prefix}/failed"

    @property
    def final(self) -> str:
        return f"{self.prefix}/final"


def keep(train: Callable[[], int], restarts: int) -> int:
    """Run `train` in a forked rank, again in a new generation after each failure of any rank of
    the job, at most `restarts` times; returns what the keeper exits with (the rank's code)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    die_with_parent()  # a lost agent (a lost machine) takes its keepers with it
    global _shared
    _shared = mmap.mmap(-1, 16)
    # torchrun's agent keeps its store across its restarts: each attempt meets under a prefix
    # of its own. Else every attempt has a store of its own, and the agents may count their
    # restarts differently (a replaced node's starts again at 0): no attempt in the prefix.
    attempt = f"scaletrain/attempt-{restart_count()}" if agent_store() else "scaletrain"
    host = _host_store() if rank == 0 and not agent_store() else None
    stop = _stop_on_termination()
    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=STORE_TIMEOUT,
        )
        code = _generations(train, restarts, store, attempt, stop)
        if code == 0:
            # The store must outlive every keeper's last look at it.
            store.add(f"{attempt}/done", 1)
            if host is not None:
                _wait_done(store, f"{attempt}/done", world)
        return code
    except dist.DistError as exc:
        if stop.is_set():  # the agent is stopping the attempt: its store may go first
            return FAILED_EXIT_CODE
        print(
            f"[keeper] rank {rank}: the job's store is lost ({exc}); the agent restarts the job",
            flush=True,
        )
        return FAILED_EXIT_CODE
    except NotFormed as exc:
        print(f"[keeper] rank {rank}: {exc}; the agent restarts the job", flush=True)
        return FAILED_EXIT_CODE
    finally:
        if host is not None:
            os.kill(host, signal.SIGKILL)
            os.waitpid(host, 0)


def _generations(
    train: Callable[[], int], restarts: int, store: dist.Store, attempt: str, stop: _Stop
) -> int:
    """The rank's generations, until one ends well, or not in a way an in-job restart mends."""
    rank = os.environ["RANK"]
    generation, froze = 0, ""
    while True:
        gen = Generation(generation, f"{attempt}/gen-{generation}")
        store.add(gen.joined, 1)
        pid = _fork_rank(train, gen.prefix, generation, froze)
        code, cause, froze = _watch(pid, store, gen, stop)
        if code == 0 or stop.is_set():
            return code
        if code in FINAL_EXIT_CODES:
            _mark(store, gen.final, f"rank {rank}: exit {code}")
            return code
        if generation >= restarts:
            print(
                f"[keeper] rank {rank}: {cause}; {restarts} in-job restarts used, the agent "
                "restarts the job",
                flush=True,
            )
            return code if code > 0 else FAILED_EXIT_CODE
        if rank == "0":
            print(f"[keeper] in-job restart {generation + 1}: {cause}", flush=True)
        generation += 1


def _wait_done(store: dist.Store, key: str, world: int) -> None:
    """Until every keeper counted its rank's good end under `key` (bounded: one that died is not
    waited for)."""
    deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
    while int(store.add(key, 0)) < world and time.monotonic() < deadline:
        time.sleep(POLL_S)


class NotFormed(Exception):
    """A generation's keepers did not all come: a machine of the job is lost."""


def _watch(pid: int, store: dist.Store, gen: Generation, stop: _Stop) -> tuple[int, str, str]:
    """Wait until rank `pid` ends, or another rank of its generation failed (then stop it);
    returns the rank's exit code, what failed, and FROZEN_ENV's value for the next rank ("" but
    when its keeper ended it frozen). The rank is stopped too when the store is lost (the error
    is raised) or when the generation does not form in time (NotFormed)."""
    rank, world = os.environ["RANK"], int(os.environ["WORLD_SIZE"])
    wait_s = JOIN_S if gen.index else FIRST_JOIN_S
    deadline, formed = time.monotonic() + wait_s, False
    try:
        while True:
            if not formed:
                came = int(store.add(gen.joined, 0))
                formed = came >= world
                if not formed and time.monotonic() > deadline:
                    _stop_rank(pid)
                    raise NotFormed(
                        f"in-job restart {gen.index}: {came} of {world} ranks' keepers came "
                        f"within {wait_s:g}s (a machine lost?)"
                    )
            ended, status = os.waitpid(pid, os.WNOHANG)
            why = froze = ""
            if not ended and (silent := _silent_s()) > FROZEN_AFTER_S:
                status, froze = _end_frozen(pid, silent)
                why = f"froze (no sign of life for {silent:.1f}s)"
            if ended or why:
                code = os.waitstatus_to_exitcode(status)
                if code != 0 and code not in FINAL_EXIT_CODES:
                    _mark(store, gen.failed, f"rank {rank} {why or _describe(code)}")
                    if code != PEER_LOST_EXIT_CODE:  # a peer's failure is not its machine's
                        record_failure(int(rank), _last_trained(), why or _describe(code))
                return code, _read(store, gen.failed), froze
            if stop.is_set():
                return _stop_rank(pid), "the agent stopped this rank", ""
            if store.check([gen.final]):
                _stop_rank(pid)
                return 1, _read(store, gen.final), ""
            if store.check([gen.failed]):
                _stop_rank(pid)
                return FAILED_EXIT_CODE, _read(store, gen.failed), ""
            time.sleep(POLL_S)
    except dist.DistError:
        with contextlib.suppress(ChildProcessError):
            _stop_rank(pid)
        raise


def _end_frozen(pid: int, silent: float) -> tuple[int, str]:
    """SIGKILL a frozen rank (the one signal a stopped process cannot hold off), saying so as its
    watchdog would; returns its wait status and what the next rank reports (FROZEN_ENV: the step
    it froze in, the seconds it was silent)."""
    rank = os.environ["RANK"]
    froze = f"{_last_trained() + 1}:{silent:.3f}"
    print(
        f"trainer: rank {rank}: error: watchdog: rank {rank} shows no sign of life for "
        f"{silent:.1f}s (frozen: stopped, or deadlocked); its keeper ends it",
        file=sys.stderr,
        flush=True,
    )
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1], froze


def _fork_rank(train: Callable[[], int], prefix: str, generation: int, froze: str) -> int:
    """Fork the rank of `generation`, told (FROZEN_ENV) that the rank before it froze when
    `froze`; it dies with its keeper (a lost node takes both)."""
    alive(False)  # a new rank is not judged before it first signs
    pid = os.fork()
    if pid:
        return pid
    code = FAILED_EXIT_CODE
    try:
        die_with_parent()
        name_process(RANK_PROCESS.format(rank=os.environ["RANK"]))
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the keeper's handler is not the rank's
        os.environ[PREFIX_ENV], os.environ[GENERATION_ENV] = prefix, str(generation)
        os.environ[FROZEN_ENV] = froze
        code = train()
    except BaseException as exc:  # the keeper hears of any failure by the exit code
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if isinstance(exc, dist.DistError) or "gloo" in first:
            code = PEER_LOST_EXIT_CODE
            print(
                f"trainer: rank {os.environ['RANK']}: a collective failed: {first[:200]}",
                file=sys.stderr,
                flush=True,
            )
        else:
            traceback.print_exc()
    finally:
        exit_now(code)


def _stop_rank(pid: int) -> int:
    """SIGTERM (the rank hands telemetry its last records), SIGKILL after STOP_GRACE_S (a rank
    blocked in a collective runs no signal handler); returns its exit code."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


class _Stop:
    """Set when torchrun's agent stops the keeper (SIGTERM): the rank is stopped, not restarted."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


def _stop_on_termination() -> _Stop:
    stop = _Stop()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.set())
    return stop


def _mark(store: dist.Store, key: str, why: str) -> None:
    """Record why `key`'s generation ended, unless a keeper already did (the first cause)."""
    store.compare_set(key, "", why)


def _read(store: dist.Store, key: str) -> str:
    return store.get(key).decode() if store.check([key]) else "no rank failed"


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    if code == PEER_LOST_EXIT_CODE:
        return PEER_LOST
    return f"exited {code}"


def trained(step: int) -> None:
    """The rank completed `step` (its keeper reads it should the rank fail; nothing without a
    keeper)."""
    if _shared is not None:
        _shared[_STEP] = step.to_bytes(8, "little")


def _last_trained() -> int:
    return int.from_bytes(_shared[_STEP], "little") if _shared is not None else 0


def alive(judged: bool = True) -> None:
    """A sign of life of the rank, for its keeper (`judged` False: from now on the rank is not
    judged, as when its watchdog stops at the end of training; nothing without a keeper)."""
    if _shared is not None:
        _shared[_ALIVE] = (time.monotonic_ns() if judged else 0).to_bytes(8, "little")


def froze_before() -> tuple[int, float] | None:
    """(step, seconds without a sign of life) of the rank this one replaces, if it froze."""
    step, _, silent = os.environ.get(FROZEN_ENV, "").partition(":")
    return (int(step), float(silent)) if silent else None


def _silent_s() -> float:
    """Seconds since the rank's last sign of life (0 while it is not judged)."""
    last = int.from_bytes(_shared[_ALIVE], "little") if _shared is not None else 0
    return (time.monotonic_ns() - last) / 1e9 if last else 0.0


def restart_count() -> int:
    """How many times torchrun's elastic agent restarted this job (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def generation() -> int:
    """How many times this attempt's ranks were restarted in-job (0 on its first generation)."""
    return int(os.environ.get(GENERATION_ENV, "0"))


def agent_store() -> bool:
    """Whether torchrun's agent hosts the job's store (it does unless
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, and then rank 0 would host it, dying with it)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _host_store() -> int:
    """A process that hosts the job's store at MASTER_ADDR:MASTER_PORT for as long as this keeper
    lives; returns its pid. Forked before this keeper has a store of its own (a store's server
    threads do not survive a fork), so it costs no new interpreter: the job's ranks, waiting for
    this store, start that much sooner."""
    pid = os.fork()
    if pid:
        return pid
    try:
        die_with_parent()
        name_process(STORE_PROCESS)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=True,
            wait_for_workers=False,
        )
        while True:  # it serves from its own threads until this process is killed
            signal.pause()
    finally:
        os._exit(FAILED_EXIT_CODE)
