"""The memory tier: the newest checkpoints as byte strings, within a fixed byte budget.

It exists so that a restore right after a save (the common case after a crash of one rank) reads
at memory speed. It never holds the only copy of anything it evicts: a checkpoint is evicted only
when the store confirms that a slower tier holds a committed copy, otherwise the new one is not
kept here instead.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping

from ckptd.tiers import CheckpointKey
from scaletrain.v1 import common_pb2


class MemoryTier:
    """Checkpoints held in process memory, oldest evicted first."""

    tier = common_pb2.TIER_MEMORY

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        # Insertion order is commit order: the first entry is the oldest.
        self._checkpoints: OrderedDict[CheckpointKey, dict[str, bytes]] = OrderedDict()
        self._used = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def put(
        self,
        key: CheckpointKey,
        files: Mapping[str, bytes],
        can_evict: Callable[[CheckpointKey], bool],
    ) -> tuple[bool, list[CheckpointKey]]:
        """Keep `files` under `key` if they fit, evicting old checkpoints that `can_evict` allows.

        Returns whether the checkpoint was kept and which checkpoints were evicted for it.
        """
        size = sum(len(data) for data in files.values())
        with self._lock:
            self._drop(key)
            if size > self.budget_bytes:
                return False, []
            victims: list[CheckpointKey] = []
            free = self.budget_bytes - self._used
            for old, old_files in self._checkpoints.items():
                if free >= size:
                    break
                if can_evict(old):
                    victims.append(old)
                    free += sum(len(data) for data in old_files.values())
            if free < size:
                return False, []
            for old in victims:
                self._drop(old)
            self._checkpoints[key] = dict(files)
            self._used += size
            return True, victims

    def has(self, key: CheckpointKey) -> bool:
        with self._lock:
            return key in self._checkpoints

    def read_range(self, key: CheckpointKey, path: str, offset: int, length: int) -> bytes:
        with self._lock:
            files = self._checkpoints.get(key)
            if files is None or path not in files:
                raise FileNotFoundError(f"{key}/{path} is not in memory")
            return files[path][offset : offset + length]

    def delete(self, key: CheckpointKey) -> bool:
        with self._lock:
            return self._drop(key)

    def list(self) -> list[CheckpointKey]:
        with self._lock:
            return list(self._checkpoints)

    def _drop(self, key: CheckpointKey) -> bool:
        files = self._checkpoints.pop(key, None)
        if files is None:
            return False
        self._used -= sum(len(data) for data in files.values())
        return True
