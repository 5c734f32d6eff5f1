"""Delayed scaling: each tensor's scale comes from the amax values of recent steps, not its own.

The state of every FP8 linear of a model lives in two stacked fp32 tensors (one row per linear,
one column per role: input, weight, grad_output), so a step's update is one all-reduce and a few
vectorised ops however many layers there are:

- `pending`: the largest amax seen this step (forward and backward write into it);
- `history`: the last `amax_history_len` steps' amax values, newest first.

`update()` folds `pending` into `history`. Before that, `pending` is reduced with MAX over the
process group, so every rank holds the same history and derives the same scales: the state is
replicated, checkpointed once, and restores at any world size.

Before the first update (`primed` false) there is no history and scales come from each tensor's
current amax, as in dynamic scaling. From then on a scale depends on the history alone, never on
the tensor being cast: that is what makes delayed scaling cheaper than dynamic, since the amax
recorded for later steps and the cast can then read the tensor in one pass (torch.compile fuses
them) instead of the cast waiting for a reduction over the whole tensor. A tensor whose history
holds no nonzero amax (all zeros so far) is cast with scale 1, Transformer Engine's initial scale.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.fp8.formats import Fp8Format
from trainer.fp8.quantize import scale_for_amax
from trainer.fp8.recipes import Fp8Recipe, Role


class Slot:
    """One linear's share of the state: views of its history and pending rows, and a tensor of
    its own for the backward pass's amax.

    A layer holds its slot, never a row number: under torch.compile a number would be a constant
    of the graph, and each layer would compile its own. The backward pass records into a tensor
    no forward touches, since under torch.compile a tensor the backward reads is saved by the
    forward, and one that a later layer's forward wrote in place (or any view of its storage)
    fails autograd's version check.
    """

    def __init__(self, owner: AmaxHistory, row: int) -> None:
        self.owner, self.recipe = owner, owner.recipe
        self.history, self.pending = owner.history[row], owner.pending[row]
        self.pending_grad = torch.zeros((), device=owner.pending.device)

    def record(self, role: Role, amax: torch.Tensor) -> None:
        """Fold a tensor's current amax (a 1-element tensor) into this step's pending value."""
        slot = self.pending_grad if role == Role.GRAD_OUTPUT else self.pending[role]
        torch.maximum(slot, amax.reshape(()), out=slot)
        self.owner.has_pending = True

    def scale(self, role: Role, amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
        """The quantization scale of `role`: from its history; from `amax` (the tensor's own)
        only before the first update. See the module doc."""
        recent = self.history[role]
        past = recent.amax() if self.recipe.amax_compute == "max" else recent[0]
        past = past.reshape(1, 1)
        options = {"margin": self.recipe.margin, "power_of_two": self.recipe.power_of_two_scales}
        from_history = scale_for_amax(past, fmt, **options)
        if self.owner.primed:  # a Python bool: torch.compile guards on it and recompiles once
            return torch.where(past > 0, from_history, torch.ones_like(from_history))
        return torch.where(past > 0, from_history, scale_for_amax(amax, fmt, **options))


class AmaxHistory:
    def __init__(
        self,
        names: list[str],
        recipe: Fp8Recipe,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.names = list(names)
        self.recipe = recipe
        self.group = group
        rows, roles = len(self.names), len(Role)
        self.history = torch.zeros(rows, roles, recipe.amax_history_len, device=device)
        self.pending = torch.zeros(rows, roles, device=device)
        self.slots = [Slot(self, row) for row in range(rows)]
        self.has_pending = False
        self.primed = False  # a step has been folded into the history

    def record(self, row: int, role: Role, amax: torch.Tensor) -> None:
        """Fold a tensor's current amax into row `row`'s pending value for this step."""
        self.slots[row].record(role, amax)

    def scale(self, row: int, role: Role, amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
        """The quantization scale of (row, role): from its history, or from `amax` without one."""
        return self.slots[row].scale(role, amax, fmt)

    @torch.no_grad()
    def update(self) -> None:
        """Reduce this step's pending amax values over the group and push them into the history.

        A collective when distributed: every rank of the group must call it at the same point.
        Without anything pending (no forward since the last update) it does nothing.
        """
        if not self.has_pending:
            return
        grad = torch.stack([slot.pending_grad for slot in self.slots])
        torch.maximum(
            self.pending[:, Role.GRAD_OUTPUT], grad, out=self.pending[:, Role.GRAD_OUTPUT]
        )
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(self.pending, op=dist.ReduceOp.MAX, group=self.group)
        self.history.copy_(self.history.roll(1, dims=-1))
        self.history[..., 0] = self.pending
        self.primed = True
        self._clear_pending()

    def _clear_pending(self) -> None:
        self.pending.zero_()
        for slot in self.slots:
            slot.pending_grad.zero_()
        self.has_pending = False

    def state_dict(self) -> dict[str, torch.Tensor]:
        """One (roles, history) tensor per linear, by module name, with this step folded in."""
        self.update()
        return {name: self.history[row] for row, name in enumerate(self.names)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore histories saved by `state_dict`; ValueError naming any linear that differs."""
        missing = sorted(set(self.names) - set(state))
        unexpected = sorted(set(state) - set(self.names))
        if missing or unexpected:
            raise ValueError(
                f"fp8 amax histories do not match the model: missing {missing}, "
                f"unexpected {unexpected}"
            )
        for row, name in enumerate(self.names):
            if state[name].shape != self.history[row].shape:
                raise ValueError(
                    f"fp8 amax history of {name} has shape {tuple(state[name].shape)}, "
                    f"expected {tuple(self.history[row].shape)} (amax_history_len changed?)"
                )
            self.history[row].copy_(state[name])
        # Saved after at least one step, unless (a checkpoint of step 0) it holds nothing yet.
        self.primed = bool(self.history.any())
        self._clear_pending()
