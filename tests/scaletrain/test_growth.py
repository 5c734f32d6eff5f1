"""An elastic job takes a returning machine in at once, unless it is flapping (`growth`)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from torch.distributed import HashStore

from scaletrain.app.agent import _held_back
from scaletrain.app.growth import (
    FLAP_WINDOW_S,
    GROW_HOLD_BASE_S,
    GROW_HOLD_MAX_S,
    Growth,
    GrowthRecord,
)


def sizes(*rounds: tuple[float, int]) -> Growth:
    """The record after the job formed at (time, size) of each round in turn."""
    growth = Growth()
    for number, (at, size) in enumerate(rounds):
        growth = growth.formed(number, size, at)
    return growth


def test_a_first_grow_and_a_loss_long_after_it_hold_nothing_back():
    grown = sizes((0, 3), (100, 2), (110, 3))
    assert grown.grows_in(110) == 0
    later = grown.formed(3, 2, 110 + FLAP_WINDOW_S + 1)
    assert later.hold_s == 0 and later.grows_in(later.formed_at) == 0


def test_a_node_lost_soon_after_a_grow_holds_the_next_grow_back():
    flapped = sizes((0, 3), (10, 2), (20, 3), (30, 2))
    assert flapped.hold_s == GROW_HOLD_BASE_S
    assert flapped.grows_in(30) == GROW_HOLD_BASE_S
    assert flapped.grows_in(30 + GROW_HOLD_BASE_S) == 0


def test_each_flap_doubles_the_hold_up_to_its_most():
    growth, at = sizes((0, 3), (1, 2)), 1.0
    holds = []
    for number in range(2, 30, 2):
        at += growth.hold_s + 1
        growth = growth.formed(number, 3, at)  # grows once the hold is over
        at += 1
        growth = growth.formed(number + 1, 2, at)  # and loses the machine again at once
        holds.append(growth.hold_s)
    assert holds[:3] == [GROW_HOLD_BASE_S, 2 * GROW_HOLD_BASE_S, 4 * GROW_HOLD_BASE_S]
    assert max(holds) == holds[-1] == GROW_HOLD_MAX_S


def test_a_grow_that_holds_for_the_flap_window_clears_the_hold():
    flapped = sizes((0, 3), (10, 2), (20, 3), (30, 2))
    # A long wait at the smaller size (the hold's own doing) is no sign of calm.
    regrown = flapped.formed(4, 3, 30 + FLAP_WINDOW_S)
    assert regrown.hold_s == GROW_HOLD_BASE_S
    # The grown size lasting the window is; then a loss holds nothing back.
    assert regrown.formed(5, 2, regrown.formed_at + FLAP_WINDOW_S).hold_s == 0
    assert regrown.formed(5, 4, regrown.formed_at + FLAP_WINDOW_S).hold_s == 0


def test_every_agent_reports_each_round_and_it_counts_once():
    growth = sizes((0, 3), (10, 2), (20, 3), (30, 2))
    assert growth.formed(3, 2, 31) is growth
    assert growth.formed(1, 1, 99) is growth


def test_the_record_in_the_store_is_shared_and_updated_once_per_round():
    store = HashStore()
    first, second = GrowthRecord(store, "run-a"), GrowthRecord(store, "run-a")
    assert first.read() == (Growth(), "")
    for number, (at, size) in enumerate([(0, 3), (10, 2), (20, 3), (30, 2)]):
        first.formed(number, size, at)
        second.formed(number, size, at + 0.5)  # the same round, from another agent
    growth, _ = GrowthRecord(store, "run-a").read()  # a machine that just joined
    assert (growth.round, growth.size, growth.formed_at) == (3, 2, 30)
    assert growth.hold_s == GROW_HOLD_BASE_S
    assert GrowthRecord(store, "run-b").read()[0] == Growth()


@pytest.fixture
def agent() -> SimpleNamespace:
    """What the patched rendezvous handler of an agent holds (`restart_on_lost_nodes`)."""
    record = GrowthRecord(HashStore(), "run")
    return SimpleNamespace(_scaletrain_growth=record, _scaletrain_read_at=0.0, _scaletrain_held=0.0)


def test_a_waiting_machine_is_held_back_while_flapping_and_said_once(agent, capsys):
    now = time.time()
    for number, (ago, size) in enumerate([(40, 3), (30, 2), (20, 3), (1, 2)]):
        agent._scaletrain_growth.formed(number, size, now - ago)
    assert _held_back(agent, 1) and _held_back(agent, 1)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("[agent] 1 machine(s) wait to join; the job lost a machine within")
    assert f"{GROW_HOLD_BASE_S:g}s after it last re-formed, not at once" in line


def test_a_waiting_machine_joins_at_once_when_the_job_is_calm(agent, capsys):
    agent._scaletrain_growth.formed(0, 2, 0.0)
    assert not _held_back(agent, 1)
    assert capsys.readouterr().out == ""
