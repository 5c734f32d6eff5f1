"""The step guard: checks each step for silent data corruption and loss spikes, replays a suspicious
step from the in-memory state before it, and applies the policy.

The step runs its body through `guard.run(step, body)`, which calls it once, and a second time when
the step must be replayed, and returns both runs' results with what it did (`Guarded`). Per step
the guard
  - before the body, verifies that the state is still what the previous step left (a checksum of
    the in-memory copy): if not, memory corrupted it in between, and the copy is put back;
  - after backward (the body calls `attempt.gradients_ready`), checksums this rank's gradients;
  - after the body, checksums the new state and gathers every rank's view of the step to every
    rank (one all_gather of a few integers), so that all ranks decide the same;
  - on a suspicious step, restores the copy, replays the body on the same batch, classifies
    (`trainer.health.sdc.classify`) and applies the policy;
  - copies the state for the next step.
Policies, for a suspicious step:
  rollback (default)  data: keep the step; corruption: keep the replay (the step redone from the
                      state before it, on healthy hardware).
  skip                data: restore the state before the step (its batch is skipped); corruption:
                      as rollback.
  alert               record and alert, change nothing: the corrupted result is kept.
  off                 no checks, no copy, no replay.
Costs per step: the rank's state gathered twice into a flat buffer (to verify it and to checksum
it), a checksum of its gradients, one all_gather of a few integers; in memory, two copies of the
rank's parameters and optimizer state (see `trainer.health.snapshot`).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

from trainer.health.inject import FaultInjector
from trainer.health.quarantine import Quarantine
from trainer.health.reduction import Reductions, Settling, watch_reductions
from trainer.health.sdc import (
    RankStats,
    Suspicion,
    Verdict,
    check,
    classify,
    consensus_values,
    float_bits,
)
from trainer.health.snapshot import StateSnapshot, checksum, local
from trainer.health.stats import RollingSignal, SpikeRule

# A loss 15% above its recent median (and well above its noise) is a spike; a gradient norm must
# triple.
LOSS_RULE = SpikeRule()
GRAD_NORM_RULE = SpikeRule(min_rise=2.0)

# report(kind, step, rank, message, attributes): an event for telemetry ("sdc", "replay", ...).
Report = Callable[[str, int, int, str, dict[str, str]], None]


class StepNumbers(Protocol):
    """What the guard compares of a run of the step body: this rank's own loss, the mean loss
    over ranks (which every rank must hold) and the gradient norm."""

    @property
    def loss(self) -> float: ...

    @property
    def global_loss(self) -> float: ...

    @property
    def grad_norm(self) -> float: ...


Numbers = TypeVar("Numbers", bound=StepNumbers)


@dataclass(frozen=True)
class StepHealth:
    """What the guard did with one step, for the step's record."""

    # This rank's own work in the step's first run, in seconds (CPU time on a CPU rank), the
    # guard's checks excluded.
    compute_s: float
    # The checksum of this rank's state after the step; None when the policy is off.
    state_checksum: int | None
    # Seconds spent replaying the step and deciding; 0 when it was not replayed.
    replay_s: float = 0.0


@dataclass(frozen=True)
class Guarded(Generic[Numbers]):
    """The runs of one step's body: `first`, and `kept`, whose numbers the run reports (the
    replay's when the step was replayed, else the first again)."""

    first: Numbers
    kept: Numbers
    health: StepHealth


class StepGuard:
    """Guards the steps of one rank; every rank of the job runs one with the same policy (one of
    trainer.health.POLICIES, which TrainConfig checks)."""

    def __init__(
        self,
        policy: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        replica_groups: Sequence[Sequence[int]],
        faults: FaultInjector,
        report: Report,
        device: torch.device,
        quarantine: Quarantine | None = None,
        check_reductions: bool = False,
    ) -> None:
        """`quarantine`: what counts the ranks the checks name (None: nobody counts).
        `check_reductions`: check FSDP's reduce-scatters (`trainer.health.reduction`)."""
        self.policy = policy
        self._quarantine = quarantine
        # The state was found changed at rest before a save copied it (`verify_before_save`),
        # and put right then: the next step reports it, as if it had found it.
        self._changed_before_save = False
        self._params = list(model.parameters())
        self._replicas = [list(group) for group in replica_groups if len(group) > 1]
        self._faults = faults
        self._report = report
        self._device = device
        self._rank = dist.get_rank()
        self._optimizer = optimizer
        self._snapshot = StateSnapshot(model, optimizer)
        faults.attach(model)
        self._reductions = watch_reductions(model, faults, check_reductions and self.enabled)
        self._loss = RollingSignal(LOSS_RULE)
        self._grad_norm = RollingSignal(GRAD_NORM_RULE)

    @property
    def enabled(self) -> bool:
        return self.policy != "off"

    def resume_signals(self, other: StepGuard) -> None:
        """Judge spikes by `other`'s recent losses and gradient norms, as if this guard had
        guarded its steps: bench/sdc_coverage.py trains many trials on from one step, each under
        a fresh guard (its copy of the state is the trial's)."""
        self._loss = copy.deepcopy(other._loss)
        self._grad_norm = copy.deepcopy(other._grad_norm)

    def run(
        self,
        step: int,
        body: Callable[[Attempt], Numbers],
        before_restore: Callable[[], None] = lambda: None,
    ) -> Guarded[Numbers]:
        """Run the step body for `step` (twice when it must be replayed) and apply the policy.
        `before_restore()` is called before the state is restored ahead of the body (a change
        at rest found): a lazy checkpoint copy of the state waits there."""
        at_rest_ok = self._verify_at_rest(before_restore) if self.enabled else True
        at_rest_ok, self._changed_before_save = at_rest_ok and not self._changed_before_save, False
        self._faults.begin_step(step)
        first = Attempt(self, step, replay=False, at_rest_ok=at_rest_ok)
        first_numbers = body(first)
        first.finished(first_numbers)
        kept, replay_s, state_checksum = first_numbers, 0.0, first.state
        if self.enabled:
            self._report_at_rest(step, first.stats)
            if first.suspicion is None:
                self._loss.add(first.loss)
                self._grad_norm.add(first.grad_norm)
                self._snapshot.commit()
            else:
                kept, replay_s, state_checksum = self._replay(step, first, body)
        self._faults.flip_parameter(step, self._params)
        self._faults.flip_optimizer_state(step, self._optimizer)
        health = StepHealth(first.compute_s, state_checksum if self.enabled else None, replay_s)
        return Guarded(first_numbers, kept, health)

    def _replay(
        self, step: int, first: Attempt, body: Callable[[Attempt], Numbers]
    ) -> tuple[Numbers, float, int]:
        """Replay the step body from the state before it; classify; apply the policy. Returns
        the replay's numbers, its seconds and the checksum of the state the policy kept."""
        started = time.perf_counter()
        if self.policy == "alert":
            self._snapshot.hold()
        self._snapshot.restore()
        second = Attempt(self, step, replay=True, at_rest_ok=True)
        numbers = body(second)
        second.finished(numbers)
        verdict = classify(first.stats, second.stats, self._replicas)
        action, state_checksum = self._apply(verdict, first, second)
        seconds = time.perf_counter() - started
        assert first.suspicion is not None
        self._report_verdict(step, first.suspicion, verdict, action, seconds)
        return numbers, seconds, state_checksum

    def _apply(self, verdict: Verdict, first: Attempt, second: Attempt) -> tuple[str, int]:
        """Put the state the policy wants in place, make it the next step's starting point, and
        return what was done with the step and the checksum of that state."""
        if verdict.corrupted and self.policy == "alert":
            self._snapshot.restore_held()
            self._snapshot.capture()
            return "kept corrupted", first.state
        if not verdict.corrupted and self.policy == "skip":
            self._snapshot.restore()
            return "skipped", self._snapshot.before_checksum()
        # The replay's result: the step redone on healthy hardware, or the same result again.
        self._snapshot.commit()
        if verdict.corrupted:
            # Normal training, unlike a spike that the data caused, which stays out of the
            # statistics it would widen.
            self._loss.add(second.loss)
            self._grad_norm.add(second.grad_norm)
            return "replayed", second.state
        # The data's spike: the next step still feels its update, and is not judged a spike.
        self._loss.excuse_next()
        self._grad_norm.excuse_next()
        return "kept", second.state

    def verify_before_save(self) -> None:
        """Verify, before a checkpoint copies the state, that it still is what the last step
        left, and put it right if not (but under the alert policy): a change at rest found only
        at the next step would be in the checkpoint already, and a restore of that step would
        bring it back. The next step reports it with every rank's view."""
        if self.enabled and not self._verify_at_rest(lambda: None):
            self._changed_before_save = True

    def _verify_at_rest(self, before_restore: Callable[[], None]) -> bool:
        """Whether the live state still is what the previous step left; a state changed in memory
        is restored from the copy (except under the alert policy)."""
        if not self._snapshot.captured:
            self._snapshot.capture()
            return True
        if self._snapshot.unchanged():
            return True
        if self.policy != "alert":
            before_restore()
            self._snapshot.restore()
        return False

    def _report_at_rest(self, step: int, stats: Sequence[RankStats]) -> None:
        changed = [rank for rank, view in enumerate(stats) if not view.at_rest_ok]
        action = "kept corrupted" if self.policy == "alert" else "restored"
        for rank in changed:
            self._event(
                "sdc",
                step - 1,
                rank,
                f"silent data corruption on rank {rank}: its parameters or optimizer state "
                f"changed in memory after step {step - 1} ({action})",
                {"stage": "at_rest", "action": action, "detected_before_step": str(step)},
            )
            if self.policy == "alert":
                self._event("alert", step - 1, rank, "corrupted state left in place", {})
        if changed and self._quarantine is not None:
            self._quarantine.named(step - 1, changed)

    def _report_verdict(
        self, step: int, suspicion: Suspicion, verdict: Verdict, action: str, seconds: float
    ) -> None:
        reasons = "; ".join(suspicion.reasons)
        self._event(
            "replay",
            step,
            -1,
            f"step {step} replayed ({reasons}): {'not ' if not verdict.reproduced else ''}"
            "reproduced",
            {
                "reasons": reasons,
                "reproduced": str(verdict.reproduced).lower(),
                "seconds": f"{seconds:.6f}",
            },
        )
        verdict_name = "sdc" if verdict.corrupted else "data"
        spike = suspicion.loss_spike or suspicion.grad_spike
        if spike is not None:
            self._event(
                "loss_spike",
                step,
                -1,
                f"step {step}: loss {suspicion.loss:.4g}, gradient norm {suspicion.grad_norm:.4g}"
                f" ({'silent data corruption' if verdict.corrupted else 'the data'}; {action})",
                {
                    "verdict": verdict_name,
                    "action": action,
                    "loss": repr(suspicion.loss),
                    "grad_norm": repr(suspicion.grad_norm),
                    "median": repr(spike.median),
                    "threshold": repr(spike.threshold),
                },
            )
        if verdict.corrupted:
            for rank in verdict.ranks:
                self._event(
                    "sdc",
                    step,
                    rank,
                    f"silent data corruption on rank {rank} at step {step}: its {verdict.stage} "
                    f"differed on replay ({action})",
                    {
                        "stage": verdict.stage,
                        "ranks": ",".join(map(str, verdict.ranks)),
                        "action": action,
                    },
                )
            if action == "kept corrupted":
                self._event("alert", step, -1, "corrupted step kept (policy alert)", {})
            if self._quarantine is not None:
                self._quarantine.named(step, verdict.ranks)

    def _event(self, kind: str, step: int, rank: int, message: str, attrs: dict[str, str]) -> None:
        if self._rank == 0:
            self._report(kind, step, rank, message, attrs)

    def _gather(self, mine: RankStats) -> list[RankStats]:
        """Every rank's view of the step, on every rank."""
        local_row = torch.tensor(mine.row(), dtype=torch.int64, device=self._device)
        rows = [torch.empty_like(local_row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, local_row)
        return [RankStats.from_row(row) for row in torch.stack(rows).tolist()]


class Attempt:
    """One run of a step body, which tells it when its gradients are ready."""

    def __init__(self, guard: StepGuard, step: int, *, replay: bool, at_rest_ok: bool) -> None:
        self._guard = guard
        self.step = step
        self.replay = replay
        self._at_rest_ok = at_rest_ok
        self._cpu = guard._device.type == "cpu"
        self._clock_started = self._clock()
        self._overhead = 0.0
        self._grads = 0
        self._reductions: Settling | None = None
        self.state = 0
        # This rank's own work in seconds (CPU time on a CPU rank), the guard's checks excluded.
        self.compute_s = 0.0
        self.stats: list[RankStats] = []
        self.suspicion: Suspicion | None = None
        # The run's loss and gradient norm at this attempt, as most ranks hold them.
        self.loss = math.nan
        self.grad_norm = math.nan

    def gradients_ready(self) -> None:
        """After backward, before clipping: inject faults, checksum this rank's gradients."""
        guard = self._guard
        if not self.replay:
            guard._faults.slow_down()
            guard._faults.flip_gradient(self.step, guard._params)
        if guard.enabled:
            started = self._clock()
            grads = (local(p.grad) for p in guard._params if p.grad is not None)
            self._grads = checksum(grads)
            if guard._reductions is not None:
                self._reductions = guard._reductions.settle()
            self._overhead += self._clock() - started

    def finished(self, numbers: StepNumbers) -> None:
        """After the body (the optimizer step and the loss all-reduce): gather every rank's view
        of its `numbers` and check them."""
        guard = self._guard
        if guard._device.type == "cuda":
            # Kernels run asynchronously: the step's compute is done only once they are.
            torch.cuda.synchronize(guard._device)
        self.compute_s = self._clock() - self._clock_started - self._overhead
        if not guard.enabled:
            return
        self.state = guard._snapshot.stage()
        reduced = self._reductions.result() if self._reductions is not None else Reductions()
        mine = RankStats(
            global_loss=float_bits(numbers.global_loss),
            grad_norm=float_bits(float(numbers.grad_norm)),
            local_loss=float_bits(float(numbers.loss)),
            grads=self._grads,
            state=self.state,
            at_rest_ok=int(self._at_rest_ok),
            reduce_inputs=reduced.inputs,
            reduce_ok=int(reduced.ok),
        )
        self.stats = guard._gather(mine)
        self.loss, self.grad_norm = consensus_values(self.stats)
        self.suspicion = check(self.stats, guard._replicas, guard._loss, guard._grad_norm)

    def _clock(self) -> float:
        return time.thread_time() if self._cpu else time.perf_counter()


def replica_groups(mesh_ranks: torch.Tensor, replicate_dim: int) -> list[list[int]]:
    """Groups of ranks that hold the same shards: those differing only along `replicate_dim` of
    the mesh (its tensor of ranks)."""
    moved = mesh_ranks.movedim(replicate_dim, -1)
    return moved.reshape(-1, moved.shape[-1]).tolist()
