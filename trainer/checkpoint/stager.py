"""Staging: copy the training state into preallocated host buffers so training can go on.

The buffers are allocated at the first save and reused by every later one (pinned memory on CUDA,
so the device-to-host copies run at full bandwidth): a copy into an existing buffer costs a memcpy,
a fresh allocation costs page faults on top.

DTensors are staged as their local shard and wrapped back into a DTensor with the live one's spec
(mesh, placements, global shape and stride), so DCP plans the staged copy exactly like the live
state and a checkpoint still reshards on load. The wrapper is built from the spec, as stock DCP's
own CPU staging does, never with `DTensor.from_local`: that moves the local tensor to the mesh's
device, so on a GPU mesh every staged buffer would be copied back into GPU memory.

The wrappers are kept with their buffers too: building a DTensor costs more than copying a small
shard into it (a third of the staging time of a 600 MB state in 300 tensors), and the one built
at the first save stays valid as long as its buffer and the live DTensor's spec do.

Parts of a state may be staged by separate calls (the checkpointer stages the small parts at
once and the model and optimizer from a background thread): buffers are kept by path, and the
calls must not overlap.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def tensor_bytes(value: Any) -> int:
    """The bytes `HostStager.stage` copies of `value` (a DTensor's local shard)."""
    with torch.no_grad():  # DTensor.to_local is then the local tensor, not a new autograd view
        return _bytes(value)


def _bytes(value: Any) -> int:
    if isinstance(value, dict):
        return sum(_bytes(v) for v in value.values())
    if isinstance(value, list):
        return sum(_bytes(v) for v in value)
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return 0


# Allocates the buffer of a stager path (shape, dtype), or declines with None.
Allocate = Callable[[str, torch.Size, torch.dtype], torch.Tensor | None]


class HostStager:
    def __init__(self, allocate: Allocate | None = None) -> None:
        """`allocate`: where CPU buffers come from (the rank's own copy, in shared memory), when
        it gives one; else, and for device tensors (pinned), ordinary host memory."""
        self._allocate = allocate
        self._buffers: dict[str, torch.Tensor] = {}
        # path -> the DTensor over that path's buffer, with the spec it was built from.
        self._wrapped: dict[str, DTensor] = {}
        self.staged_bytes = 0

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer, by path (a path is a state's keys joined with dots, led by one)."""
        return self._buffers

    def stage(
        self, state: dict[str, Any], stream: torch.cuda.Stream | None = None
    ) -> dict[str, Any]:
        """A copy of `state` whose tensors live in this stager's host buffers.

        The copy is complete when this returns (device copies are synchronised: those on
        `stream` if given, which the caller made current, else the whole device), so the caller
        may mutate `state` at once. The returned tensors are overwritten by the next `stage` call
        of the same paths: the caller must be done with them by then.
        """
        self.staged_bytes = 0
        with torch.no_grad():  # DTensor.to_local is then the local tensor itself, not a view
            staged = self._copy(state, "")
        if stream is not None:
            stream.synchronize()
        elif torch.cuda.is_available():
            torch.cuda.synchronize()
        return staged

    def _copy(self, value: Any, path: str) -> Any:
        if isinstance(value, dict):
            return {k: self._copy(v, f"{path}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [self._copy(v, f"{path}.{i}") for i, v in enumerate(value)]
        if isinstance(value, DTensor):
            local = self._into_buffer(value.to_local(), path)
            kept = self._wrapped.get(path)
            if kept is not None and kept.to_local() is local and kept._spec == value._spec:
                return kept
            self._wrapped[path] = DTensor(local, value._spec, requires_grad=False)
            return self._wrapped[path]
        if isinstance(value, torch.Tensor):
            return self._into_buffer(value, path)
        return copy.deepcopy(value)

    def _into_buffer(self, tensor: torch.Tensor, path: str) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = None
            if self._allocate is not None and not tensor.is_cuda:
                buffer = self._allocate(path, tensor.shape, tensor.dtype)
            if buffer is None:
                buffer = torch.empty(
                    tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda
                )
            self._buffers[path] = buffer
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        self.staged_bytes += buffer.numel() * buffer.element_size()
        return buffer
