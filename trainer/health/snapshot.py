"""In-memory copies of this rank's training state, and exact checksums of tensors.

The state a step changes is the rank's parameter shards and their optimizer state (AdamW moments,
step counts). The snapshot holds two flat copies of it, one contiguous buffer per device and dtype:
`before`, the state the current step started from (what a suspicious step is replayed from, and
what memory corrupted between steps is restored from), and `after`, where the state the step left is
gathered to be checksummed and compared, and which then becomes the next step's `before`. Gathering
a hundred tensors into one buffer is one kernel, where a checksum per tensor would be a hundred:
per-tensor launches, not bytes, dominate on small models. The buffers are allocated once and reused;
they cost twice the rank's parameters and optimizer state in memory.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# Integer views of the same width, for checksums of bit patterns.
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK64 = (1 << 64) - 1

# (parameter index, optimizer state name or "" for the parameter itself) of each tensor, in order.
Layout = list[tuple[int, str]]
GroupKey = tuple[torch.device, torch.dtype]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: writing it writes the parameter), or the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def checksum(tensors: Iterable[torch.Tensor]) -> int:
    """An order-sensitive checksum of the exact bits of `tensors`, as a signed 64-bit integer.

    Each tensor's bits are summed as integers (a flipped bit changes that sum by a power of two)
    and the sums are combined with weights by position. One device synchronisation per device.
    """
    sums: dict[torch.device, list[torch.Tensor]] = {}
    for index, tensor in enumerate(tensors):
        sums.setdefault(tensor.device, []).append(bit_sum(tensor) * (index + 1))
    return signed64(sum(int(torch.stack(parts).sum().item()) for parts in sums.values()))


def bit_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of `tensor`'s bit patterns as integers (a 0-dim int64 tensor, not synchronised)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=tensor.device)
    # Summed in the values' own width, wrapping around: as exact as a wider sum for a flipped bit
    # (the sum changes by 2^bit modulo 2^width), and several times faster than widening each value.
    width = _INT_OF_WIDTH[flat.element_size()]
    return flat.view(width).sum(dtype=width).to(torch.int64)


def signed64(total: int) -> int:
    """`total` wrapped to a signed 64-bit integer."""
    total &= _MASK64
    return total - (1 << 64) if total >= 1 << 63 else total


class _FlatCopy:
    """One copy of a list of tensors: a flat buffer per (device, dtype), in the tensors' order."""

    def __init__(self) -> None:
        self.layout: Layout | None = None
        self._flats: dict[GroupKey, torch.Tensor] = {}
        # The checksum of what `fill` copied in last.
        self.sum = 0

    def fill(self, layout: Layout, tensors: list[torch.Tensor]) -> None:
        """Copy `tensors` (described by `layout`) in, allocating only when their shapes changed."""
        groups = _group(tensors)
        sizes = {key: sum(t.numel() for t in group) for key, group in groups.items()}
        if {key: flat.numel() for key, flat in self._flats.items()} != sizes:
            self._flats = {
                key: torch.empty(size, dtype=key[1], device=key[0]) for key, size in sizes.items()
            }
        with torch.no_grad():
            for key, group in groups.items():
                torch.cat([t.detach().reshape(-1) for t in group], out=self._flats[key])
        self.layout = layout
        # One reduction per buffer. Position-blind, unlike `checksum`, but any single flipped bit
        # still changes it; equality of the buffers would cost several times more.
        self.sum = signed64(sum(int(bit_sum(flat).item()) for flat in self._flats.values()))

    def copy_into(self, tensors: list[torch.Tensor]) -> None:
        """Write the copy back into `tensors` (those it was filled from, in the same order)."""
        with torch.no_grad():
            for key, group in _group(tensors).items():
                parts = self._flats[key].split([t.numel() for t in group])
                for tensor, part in zip(group, parts, strict=True):
                    tensor.copy_(part.view_as(tensor))


def _group(tensors: list[torch.Tensor]) -> dict[GroupKey, list[torch.Tensor]]:
    groups: dict[GroupKey, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return groups


class StateSnapshot:
    """The state before the current step (`before`) and after it (`after`) of one rank."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._params = list(model.parameters())
        self._optimizer = optimizer
        self._before = _FlatCopy()
        self._after = _FlatCopy()
        # A staged state set aside (`hold`), allocated only by whoever needs it: the alert policy.
        self._held: _FlatCopy | None = None

    @property
    def captured(self) -> bool:
        return self._before.layout is not None

    def stage(self) -> int:
        """Gather the live state into `after`; return its checksum (what replicas compare)."""
        layout, tensors = self._live()
        self._after.fill(layout, tensors)
        return self._after.sum

    def commit(self) -> None:
        """The staged state becomes `before`: the state the next step starts from."""
        self._before, self._after = self._after, self._before

    def capture(self) -> None:
        """Take the live state as `before` (stage and commit)."""
        self.stage()
        self.commit()

    def unchanged(self) -> bool:
        """Whether the live state still is `before` (nothing corrupted it at rest): same tensors,
        same checksum. Uses `after` as scratch."""
        layout, tensors = self._live()
        self._after.fill(layout, tensors)
        return self._after.layout == self._before.layout and self._after.sum == self._before.sum

    def restore(self) -> None:
        """Put `before` back into the live state; optimizer state it predates is dropped."""
        self._put_back(self._before)

    def before_checksum(self) -> int:
        return self._before.sum

    def hold(self) -> None:
        """Set the staged state aside, so that staging again (a replay) does not overwrite it."""
        spare = self._held or _FlatCopy()
        self._held, self._after = self._after, spare

    def restore_held(self) -> None:
        """Put the state set aside by `hold` back into the live state, which must hold the same
        tensors (as it does after replaying the step)."""
        assert self._held is not None
        self._put_back(self._held)

    def _put_back(self, copy: _FlatCopy) -> None:
        if copy.layout is None:
            raise RuntimeError("nothing was copied yet")
        kept = {index for index, name in copy.layout if name}
        for index, param in enumerate(self._params):
            if index not in kept:
                self._optimizer.state.pop(param, None)
        copy.copy_into(self._tensors(copy.layout))

    def _live(self) -> tuple[Layout, list[torch.Tensor]]:
        """The layout and tensors of the live state: each parameter, then its tensor state."""
        layout: Layout = []
        for index, param in enumerate(self._params):
            layout.append((index, ""))
            state = self._optimizer.state.get(param, {})
            layout.extend(
                (index, name) for name in sorted(state) if isinstance(state[name], torch.Tensor)
            )
        return layout, self._tensors(layout)

    def _tensors(self, layout: Layout) -> list[torch.Tensor]:
        tensors = []
        for index, name in layout:
            param = self._params[index]
            tensors.append(local(param if not name else self._optimizer.state[param][name]))
        return tensors
