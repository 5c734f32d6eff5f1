"""An in-memory copy of this rank's training state, and exact checksums of tensors.

The state a step changes is the rank's parameter shards and their optimizer state (AdamW moments,
step counts): a copy of it taken after each verified step is what a suspicious step is replayed
from, and what memory corrupted between steps is restored from. Buffers are allocated once, on the
tensors' own devices, and refilled in place every step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator

import torch

# Integer views of the same width, for checksums of bit patterns.
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK64 = (1 << 64) - 1


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: writing it writes the parameter), or the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def checksum(tensors: Iterable[torch.Tensor]) -> int:
    """An order-sensitive checksum of the exact bits of `tensors`, as a signed 64-bit integer.

    Each tensor's bits are summed as integers (a flipped bit changes that sum by a power of two)
    and the sums are combined with weights by position. One device synchronisation per device.
    """
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    for index, tensor in enumerate(tensors):
        by_device[tensor.device].append((index, tensor))
    total = 0
    for device, items in by_device.items():
        sums = torch.stack([_bit_sum(tensor) for _, tensor in items])
        weights = torch.tensor([index + 1 for index, _ in items], dtype=torch.int64, device=device)
        total += int((sums * weights).sum().item())
    total &= _MASK64
    return total - (1 << 64) if total >= 1 << 63 else total


def _bit_sum(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=tensor.device)
    return flat.view(_INT_OF_WIDTH[flat.element_size()]).sum(dtype=torch.int64)


class StateSnapshot:
    """A copy of the parameters' local shards and optimizer state of one rank."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._params = list(model.parameters())
        self._optimizer = optimizer
        # (parameter index, state name) of every optimizer tensor copied; None before any capture.
        self._layout: list[tuple[int, str]] | None = None
        self._buffers: list[torch.Tensor] = []
        self.checksum = 0

    def live(self) -> Iterator[torch.Tensor]:
        """The tensors of the live state, in a fixed order: each parameter, then its state."""
        for param, (_, names) in zip(self._params, self._state_names(), strict=True):
            yield local(param)
            state = self._optimizer.state.get(param, {})
            for name in names:
                yield local(state[name])

    def live_checksum(self) -> int:
        return checksum(self.live())

    def capture(self, known_checksum: int | None = None) -> int:
        """Copy the live state into the snapshot; return (and keep) its checksum, which is
        `known_checksum` when the caller just computed it of the live state."""
        layout = [(index, name) for index, names in self._state_names() for name in names]
        if layout != self._layout:
            # The optimizer created its state (first step) or changed it: allocate once more.
            self._layout = layout
            self._buffers = [torch.empty_like(tensor) for tensor in self.live()]
        with torch.no_grad():
            for buffer, tensor in zip(self._buffers, self.live(), strict=True):
                buffer.copy_(tensor)
        self.checksum = checksum(self._buffers) if known_checksum is None else known_checksum
        return self.checksum

    def restore(self) -> None:
        """Put the snapshot back into the live state; optimizer state it predates is dropped."""
        if self._layout is None:
            raise RuntimeError("restore before any capture")
        captured = {index for index, _ in self._layout}
        for index, param in enumerate(self._params):
            if index not in captured:
                self._optimizer.state.pop(param, None)
        with torch.no_grad():
            for buffer, tensor in zip(self._buffers, self._captured_live(), strict=True):
                tensor.copy_(buffer)

    def _captured_live(self) -> Iterator[torch.Tensor]:
        """The live tensors that the snapshot holds copies of, in its order."""
        names: dict[int, list[str]] = defaultdict(list)
        for index, name in self._layout or []:
            names[index].append(name)
        for index, param in enumerate(self._params):
            yield local(param)
            state = self._optimizer.state.get(param, {})
            for name in names.get(index, []):
                yield local(state[name])

    def _state_names(self) -> list[tuple[int, list[str]]]:
        """Per parameter, the names of its tensor-valued optimizer state, sorted."""
        result = []
        for index, param in enumerate(self._params):
            state = self._optimizer.state.get(param, {})
            result.append(
                (index, sorted(k for k, v in state.items() if isinstance(v, torch.Tensor)))
            )
        return result
