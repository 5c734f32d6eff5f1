"""Every random number generator a rank uses, captured and restored as one picklable value.

Stored per rank in the checkpoint under `rng.rank<R>` (as pickled bytes, so DCP keeps it opaque),
so a resumed rank continues each generator exactly where it stopped.
"""

from __future__ import annotations

import pickle
import random

import numpy as np
import torch


def capture() -> bytes:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return pickle.dumps(state)


def restore(blob: bytes) -> None:
    state = pickle.loads(blob)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def key(rank: int) -> str:
    return f"rank{rank}"
