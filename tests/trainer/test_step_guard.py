"""The step guard on a real model and optimizer in a one-rank gloo group, in this process.

Each test trains the same tiny model for a few steps with the step shape of trainer.step, with and
without an injected fault, and compares the final parameters bit for bit. The multi-rank behaviour
(which rank is named, stragglers) is proven by tests/trainer/test_health_e2e.py under torchrun.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.health.faults import FaultPlan
from trainer.health.guard import Attempt, StepGuard, replica_groups
from trainer.health.inject import FaultInjector
from trainer.health.snapshot import checksum

STEPS = 16
VOCAB = 32


@pytest.fixture(scope="module", autouse=True)
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@dataclass(frozen=True)
class Numbers:
    loss: float
    global_loss: float
    grad_norm: float


@dataclass
class Outcome:
    params: int
    losses: list[float]
    events: list[tuple[str, int, int, dict[str, str]]]
    replay_seconds: list[float]
    # The checksum of the parameters a checkpoint after step `save_at` copied.
    saved: int | None = None


def train(
    policy: str, *faults: str, loss_spike: int | None = None, save_at: int | None = None
) -> Outcome:
    """STEPS steps of a tiny model under a guard with `policy` and the --inject-sdc `faults`;
    with `save_at`, a checkpoint copies the parameters after that step, as the loop saves."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    plan = FaultPlan.parse(sdc=faults, loss_spikes=[f"step={loss_spike}"] if loss_spike else [])
    injector = FaultInjector(plan, 0, VOCAB, torch.device("cpu"))
    events: list[tuple[str, int, int, dict[str, str]]] = []
    guard = StepGuard(
        policy,
        model,
        optimizer,
        replica_groups=replica_groups(torch.arange(1).view(1, 1), 0),
        faults=injector,
        report=lambda kind, step, rank, message, attributes: events.append(
            (kind, step, rank, attributes)
        ),
        device=torch.device("cpu"),
    )
    data = torch.Generator().manual_seed(1)
    losses, replays, saved = [], [], None
    for step in range(1, STEPS + 1):
        # Counting sequences over the first half of the vocabulary: learnable in a few steps.
        starts = torch.randint(0, VOCAB // 2, (4, 1), generator=data)
        tokens = (starts + torch.arange(9)) % (VOCAB // 2)
        inputs, targets = injector.corrupt_batch(step, tokens[:, :-1], tokens[:, 1:])
        guarded = guard.run(step, functools.partial(step_body, model, optimizer, inputs, targets))
        losses.append(guarded.kept.global_loss)
        replays.append(guarded.health.replay_s)
        if step == save_at:
            guard.verify_before_save()
            saved = checksum(model.parameters())
    return Outcome(checksum(model.parameters()), losses, events, replays, saved)


def step_body(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    attempt: Attempt,
) -> Numbers:
    """The body of a step as trainer.step runs it: backward, clip, optimizer step, the mean loss."""
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    attempt.gradients_ready()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss_sum = loss.detach().clone()
    dist.all_reduce(loss_sum)
    return Numbers(loss.item(), loss_sum.item(), grad_norm.item())


@pytest.fixture(scope="module")
def clean() -> Outcome:
    return train("rollback")


def kinds(outcome: Outcome) -> list[tuple[str, int]]:
    return [(kind, step) for kind, step, _, _ in outcome.events]


def test_a_clean_run_raises_nothing_and_the_guard_does_not_change_training(
    clean: Outcome,
) -> None:
    assert clean.events == []
    assert train("off").params == clean.params


def test_a_flipped_gradient_is_caught_replayed_and_training_continues_as_if_clean(
    clean: Outcome,
) -> None:
    hit = train("rollback", "step=12,rank=0")
    assert kinds(hit) == [("replay", 12), ("loss_spike", 12), ("sdc", 12)]
    sdc = hit.events[2]
    assert (sdc[2], sdc[3]["stage"], sdc[3]["action"]) == (0, "gradients", "replayed")
    assert hit.params == clean.params and hit.losses == clean.losses
    assert hit.replay_seconds[11] > 0 and hit.replay_seconds[10] == 0


def test_a_parameter_flipped_in_memory_is_restored_before_the_next_step(clean: Outcome) -> None:
    hit = train("rollback", "step=12,rank=0,target=param")
    assert kinds(hit) == [("sdc", 12)]
    assert hit.events[0][3] == {
        "stage": "at_rest",
        "action": "restored",
        "detected_before_step": "13",
    }
    assert hit.params == clean.params


def test_under_the_alert_policy_the_corrupted_step_is_kept_and_an_alert_raised(
    clean: Outcome,
) -> None:
    hit = train("alert", "step=12,rank=0")
    assert kinds(hit) == [("replay", 12), ("loss_spike", 12), ("sdc", 12), ("alert", 12)]
    assert hit.events[2][3]["action"] == "kept corrupted"
    assert hit.params != clean.params


def test_a_bad_batch_is_classified_as_data_and_the_skip_policy_drops_its_update(
    clean: Outcome,
) -> None:
    kept = train("rollback", loss_spike=12)
    skipped = train("skip", loss_spike=12)
    for outcome, action in ((kept, "kept"), (skipped, "skipped")):
        spikes = [event for event in outcome.events if event[0] == "loss_spike"]
        assert spikes[0][1] == 12
        assert (spikes[0][3]["verdict"], spikes[0][3]["action"]) == ("data", action)
        assert "sdc" not in [kind for kind, *_ in outcome.events]
    assert kept.losses[:12] == skipped.losses[:12] == [*clean.losses[:11], kept.losses[11]]
    assert skipped.params != kept.params


def test_a_parameter_changed_at_rest_before_a_save_is_put_right_before_the_checkpoint_copies_it(
    clean: Outcome,
) -> None:
    # The flip lands after step 8, before the save of step 8 copies the state: the checkpoint
    # must hold the state step 8 left, or a restore of step 8 would bring the corruption back.
    hit = train("rollback", "step=8,rank=0,target=param", save_at=8)
    assert hit.saved == train("rollback", save_at=8).saved
    assert hit.params == clean.params
    assert kinds(hit) == [("sdc", 8)]
    assert hit.events[0][3]["stage"] == "at_rest"
