"""--inject-sdc's bit classes, random elements and new targets, and the reduce-scatter check.

What bench/sdc_coverage.py measures rests on these: a flip of class `bits` changes exactly one
bit of that class in exactly one element, drawn the same way for the same flags; the hooks strike
the first run of their step and never its replay; a reduce-scatter whose result does not sum to
its inputs is suspicious and names its rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from trainer.health.faults import BIT_CLASSES, FaultPlan, SdcFault
from trainer.health.inject import FaultInjector, FloatBits
from trainer.health.reduction import WatchedReduceScatter
from trainer.health.sdc import RankStats, check, classify
from trainer.health.stats import RollingSignal, SpikeRule

CPU = torch.device("cpu")


def injector(*faults: SdcFault) -> FaultInjector:
    return FaultInjector(FaultPlan(sdc=faults), 0, 256, CPU)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("step=3,rank=1,element=smallest", "element: must be one of largest, random, got"),
        ("step=3,rank=1,bits=mantissa", "bits: must be one of sign, exponent, mantissa-high, "),
        ("step=3,rank=1,bit=3,bits=sign", "give bit or bits, not both"),
        ("step=3,rank=1,target=weights", "target: must be one of grad, param, optim, activation"),
        ("step=3,rank=1,seed=-1", "seed: must not be negative"),
    ],
)
def test_a_bad_new_sdc_field_is_refused_in_one_line(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as caught:
        FaultPlan.parse(sdc=[text])
    assert str(caught.value).startswith(f"--inject-sdc {text!r}") and "\n" not in str(caught.value)


def test_the_new_fields_parse_and_the_old_syntax_keeps_its_defaults() -> None:
    plan = FaultPlan.parse(
        sdc=["step=3,rank=1", "step=4,rank=0,target=reduction,element=random,bits=sign,seed=7"]
    )
    assert plan.sdc == (
        SdcFault(3, 1, "grad", None, "largest", None, 0),
        SdcFault(4, 0, "reduction", None, "random", "sign", 7),
    )


def test_the_bit_classes_split_a_float32_into_its_fields() -> None:
    floats = FloatBits.of(torch.float32)
    assert [list(floats.bit_range(c)) for c in BIT_CLASSES] == [
        [31],
        list(range(23, 31)),
        list(range(11, 23)),
        list(range(0, 11)),
    ]
    assert list(FloatBits.of(torch.bfloat16).bit_range("exponent")) == list(range(7, 15))


@pytest.mark.parametrize("bits", BIT_CLASSES)
def test_a_random_flip_changes_one_bit_of_its_class_in_one_element(bits: str) -> None:
    values = torch.randn(300, generator=torch.Generator().manual_seed(0))
    shards = [values[:100].clone(), values[100:].clone()]
    struck = []
    for seed in range(8):
        grads = [shard.clone() for shard in shards]
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        fault = SdcFault(2, 0, element="random", bits=bits, seed=seed)
        injector(fault).flip_gradient(2, params)
        before = torch.cat(shards).view(torch.int32)
        after = torch.cat([p.grad for p in params]).view(torch.int32)
        (index,) = (before != after).nonzero().flatten().tolist()
        flipped = int(before[index] ^ after[index]) & 0xFFFFFFFF
        assert flipped.bit_count() == 1
        assert flipped.bit_length() - 1 in FloatBits.of(torch.float32).bit_range(bits)
        struck.append(index)
    assert len(set(struck)) > 4  # elements drawn, not always the same one


def test_the_same_flags_strike_the_same_element_and_bit() -> None:
    fault = SdcFault(5, 0, "param", element="random", bits="mantissa-high", seed=3)
    results = []
    for _ in range(2):
        param = torch.nn.Parameter(torch.linspace(-1, 1, 64))
        injector(fault).flip_parameter(5, [param])
        results.append(param.detach().clone())
    assert torch.equal(results[0].view(torch.int32), results[1].view(torch.int32))
    assert not torch.equal(results[0], torch.linspace(-1, 1, 64))


def test_an_optimizer_state_flip_strikes_its_moments_after_the_step() -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    states = list(optimizer.state.values())
    before = [{name: value.clone() for name, value in state.items()} for state in states]
    faults = injector(SdcFault(1, 0, "optim", element="random", bits="sign"))
    faults.flip_optimizer_state(2, optimizer)  # another step: nothing
    faults.flip_optimizer_state(1, optimizer)
    changed = [
        name
        for state, old in zip(states, before, strict=True)
        for name, value in state.items()
        if not torch.equal(value, old[name])
    ]
    assert len(changed) == 1


class Blocks(torch.nn.Module):
    """Two blocks under `layers`, as the trainer's Transformer holds them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(8, 8), "1": torch.nn.Linear(8, 8)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return x


def run(
    model: Blocks, faults: FaultInjector, step: int, replay: bool = False
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A forward and backward of `step` (its first run: the guard arms the injector's hooks, or
    its replay: it does not): the output and the weight gradients."""
    model.zero_grad()
    if not replay:
        faults.begin_step(step)
    out = model(torch.ones(2, 8))
    out.sum().backward()
    return out.detach(), [b.weight.grad.clone() for b in model.layers.values()]


@pytest.mark.parametrize("target", ["activation", "backward"])
def test_a_block_hook_strikes_its_step_once_and_never_the_replay(target: str) -> None:
    model = Blocks()
    faults = injector(SdcFault(3, 0, target, element="random", bits="exponent"))
    clean = run(model, injector(), 3)
    faults.attach(model)
    assert run(model, faults, 2)[0].equal(clean[0])  # another step
    struck = run(model, faults, 3)
    if target == "activation":
        assert not struck[0].equal(clean[0])
    else:  # backward: the output is clean, a gradient is not
        assert struck[0].equal(clean[0])
        assert not all(map(torch.equal, struck[1], clean[1]))
    replayed = run(model, faults, 3, replay=True)
    assert replayed[0].equal(clean[0]) and all(map(torch.equal, replayed[1], clean[1]))
    faults.detach()


def test_a_model_without_blocks_refuses_a_block_target() -> None:
    with pytest.raises(ValueError, match="this rank holds no block"):
        injector(SdcFault(3, 0, "activation")).attach(torch.nn.Linear(2, 2))


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def reduce(
    watch: WatchedReduceScatter, group: dist.ProcessGroup, sent: torch.Tensor
) -> torch.Tensor:
    out = torch.empty_like(sent)
    watch(out, sent, group, dist.ReduceOp.SUM)
    return out


@pytest.mark.parametrize(("bit", "caught"), [(31, True), (30, True), (24, True), (0, False)])
def test_the_reduce_scatter_check_passes_a_true_result_and_fails_a_flipped_one(
    one_rank_group: dist.ProcessGroup, bit: int, caught: bool
) -> None:
    sent = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    honest = WatchedReduceScatter(injector(), check=True)
    reduce(honest, one_rank_group, sent)
    clean = honest.settle().result()
    assert clean.ok
    faults = injector(SdcFault(1, 0, "reduction", bit=bit))
    struck = WatchedReduceScatter(faults, check=True)
    faults.begin_step(1)
    assert not reduce(struck, one_rank_group, sent).equal(sent)
    reductions = struck.settle().result()
    # The lowest mantissa bit of an element is below the rounding the check must allow.
    assert reductions.ok is not caught
    assert reductions.inputs == clean.inputs != 0  # what was sent did not change


def stats(reduce_inputs: int = 0, reduce_ok: int = 1, grads: int = 0) -> RankStats:
    return RankStats(1, 2, 3, grads, 5, 1, reduce_inputs, reduce_ok)


def test_a_failed_reduce_scatter_check_is_suspicious_and_names_its_rank() -> None:
    signals = [RollingSignal(SpikeRule()) for _ in range(2)]
    first = [stats(), stats(reduce_ok=0, grads=9), stats(grads=9), stats()]
    suspicion = check(first, [], *signals)
    assert suspicion is not None and suspicion.ranks == [1]
    verdict = classify(first, [stats()] * 4, [[1, 2]])
    assert (verdict.stage, verdict.ranks, verdict.corrupted) == ("reduce-scatter", [1], True)


def test_a_replay_that_sends_other_inputs_names_the_rank_whose_backward_changed() -> None:
    first = [stats(7, grads=1), stats(8, grads=9), stats(7, grads=9), stats(7, grads=1)]
    replay = [stats(7, grads=1), stats(5, grads=1), stats(7, grads=1), stats(7, grads=1)]
    verdict = classify(first, replay, [])
    assert (verdict.stage, verdict.ranks) == ("backward", [1])
