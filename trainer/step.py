"""One training step, the same in the trainer and in the layout proof.

`train_step` runs forward and backward over the step's micro-batches, clips the gradients, steps
the optimizer, takes the loss over the ranks and balances the experts. `trainer.train` runs it
under the step guard and the watchdog; `trainer.parallel.probe` runs it bare, on every layout and
on the one-process reference, so the tests that prove every layout trains like one process prove
this function, not a copy of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from trainer.parallel.expert import ExpertLoad

if TYPE_CHECKING:
    from trainer.health.guard import StepGuard, StepHealth


class StepModel(Protocol):
    """What a step needs of the model: a `ParallelModel`, or the probe's plain one-process model."""

    def micro_batches(
        self, inputs: torch.Tensor, targets: torch.Tensor, count: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None: ...

    def backward(self, loss: torch.Tensor | None, micro_batches: int = 1) -> None: ...

    def mean_of(self, losses: list[torch.Tensor | None]) -> torch.Tensor | None: ...

    def clip_grad_norm_(self, max_norm: float) -> float: ...

    def mean_loss(self, loss: torch.Tensor | None) -> float: ...

    def after_optimizer_step(self) -> ExpertLoad | None: ...


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds one run of the step body spent in each phase."""

    forward: float
    backward: float
    optimizer: float
    comm_wait: float


@dataclass(frozen=True)
class Attempted:
    """One run of the step body; the step guard may run it twice (a replay)."""

    # This rank's loss; on pipeline ranks without the last stage, which have none, the global one.
    loss: float
    global_loss: float
    grad_norm: float
    times: PhaseTimes


@dataclass(frozen=True)
class StepResult:
    """What a step did, for the run's record."""

    # Of the run of the body that training kept: the replay's when the guard replayed the step.
    loss: float
    global_loss: float
    grad_norm: float
    # Of the step as first run: a replay's time is counted apart, in `health.replay_s`.
    times: PhaseTimes
    expert_load: ExpertLoad | None
    # What the step guard did; None for a step run without one.
    health: StepHealth | None


def _nothing(*_: object) -> None:
    return None


def train_step(
    model: StepModel,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    max_grad_norm: float,
    grad_accum_steps: int = 1,
    guard: StepGuard | None = None,
    step: int = 0,
    progress: Callable[[str], None] = _nothing,
    before_update: Callable[[], None] = _nothing,
) -> StepResult:
    """Train one step on `batch` (this data-parallel rank's slice of the global batch).

    Under `guard`, the body runs as the guard decides (once, twice when replayed) for step `step`.
    `progress(phase)` is called as each phase begins, for the watchdog. `before_update()` is
    called before the first change to the parameters and optimizer state (the optimizer step, or
    the guard restoring them before the body): a lazy checkpoint copy of the previous step's
    state waits there. Expert balancing runs once, after the guard: it changes buffers the
    guard's copy of the state does not hold, so a replay must not run it again.
    """
    inputs, targets = batch

    def body(gradients_ready: Callable[[], None]) -> Attempted:
        t = time.perf_counter()
        forward = backward = 0.0
        # Gradient accumulation: FSDP reduces gradients in the last micro-batch's backward.
        losses = []
        for micro_inputs, micro_targets in model.micro_batches(inputs, targets, grad_accum_steps):
            progress("forward")
            # Under pipeline parallelism forward runs the whole schedule, backward included.
            losses.append(model.forward(micro_inputs, micro_targets))
            elapsed, t = _lap(t)
            forward += elapsed
            progress("backward")
            model.backward(losses[-1], grad_accum_steps)
            elapsed, t = _lap(t)
            backward += elapsed
        loss = model.mean_of(losses)
        gradients_ready()
        progress("optimizer")
        grad_norm = model.clip_grad_norm_(max_grad_norm)
        before_update()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        optimizer_s, t = _lap(t)
        progress("loss all-reduce")
        # The mean loss over ranks is what the run reports; its all-reduce is our comm wait.
        global_loss = model.mean_loss(loss)
        comm_wait, _ = _lap(t)
        times = PhaseTimes(forward, backward, optimizer_s, comm_wait)
        own = global_loss if loss is None else float(loss)
        return Attempted(own, global_loss, grad_norm, times)

    if guard is None:
        first = kept = body(_nothing)
        health = None
    else:
        guarded = guard.run(step, lambda attempt: body(attempt.gradients_ready), before_update)
        first, kept, health = guarded.first, guarded.kept, guarded.health
    expert_load = model.after_optimizer_step()
    return StepResult(kept.loss, kept.global_loss, kept.grad_norm, first.times, expert_load, health)


def _lap(start: float) -> tuple[float, float]:
    now = time.perf_counter()
    return now - start, now
