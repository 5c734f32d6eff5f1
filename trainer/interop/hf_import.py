"""`--init-from-hf DIR`: start a run from a Hugging Face Llama's weights, in any parallel layout.

Every rank reads only its own shard of each tensor: the model's (sharded, DTensor) state dict,
keyed by HF's names, is loaded with `dcp.load` through DCP's own `HuggingFaceStorageReader`, so
DCP plans the resharding from the safetensors headers as it does for our own checkpoints. The one
change to the stock reader: a `wq`/`wk` read fetches the rows of HF's layout that hold the rows
asked for (`trainer.interop.hf.rope_order`), so the RoPE permutation needs no gathered tensor.
A model with tied embeddings (Llama 3.2 1B and 3B) has no `lm_head` in its files: our untied
output is loaded from the embedding in a second pass, and trains on its own from there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from trainer.interop.hf import (
    OUTPUT,
    check_matches,
    hf_name,
    read_hf_model,
    rope_order,
    rope_permuted,
)
from trainer.model.llama import ModelArgs, Transformer


class RopeReorderingReader(HuggingFaceStorageReader):
    """DCP's HF safetensors reader, reading the tensors named in `head_dims` (HF's `q_proj` and
    `k_proj`) in our RoPE row order (`rope_order`)."""

    def __init__(self, path: str, head_dims: dict[str, int]) -> None:
        super().__init__(path)
        self.head_dims = head_dims

    def _process_read_request(self, f: Any, req: ReadItem, planner: LoadPlanner) -> None:
        """The stock reader slices the file's tensor at the request's offsets; a reordered one
        takes the rows it needs from the span of heads they lie in (one or a few heads)."""
        name = req.storage_index.fqn
        if name not in self.head_dims:
            super()._process_read_request(f, req, planner)
            return
        stored = f.get_slice(name)
        (row, col), (rows, cols) = req.storage_offsets, req.lengths
        order = rope_order(stored.get_shape()[0], self.head_dims[name], to_hf=False)
        wanted = order[row : row + rows]
        low, high = int(wanted.min()), int(wanted.max()) + 1
        tensor = stored[low:high, col : col + cols][wanted - low]
        target = planner.resolve_tensor(req).detach()
        target.copy_(tensor)
        planner.commit_tensor(req, target)


def whole_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter's full shape, from the model built on the meta device (no storage)."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in Transformer(args).state_dict().items()}


def check_init(directory: Path, args: ModelArgs) -> None:
    """Refuse, in one line, an HF directory that `load_hf_weights` could not load into a model
    of `args` (`trainer.interop.hf.read_hf_model`, `check_matches`): what `scaletrain run` asks
    before it starts anything, and every rank before any collective."""
    check_matches(read_hf_model(directory), whole_shapes(args), args)


def load_hf_weights(model: nn.Module, directory: Path, args: ModelArgs) -> None:
    """Overwrite `model`'s parameters, laid out in any way (FSDP2, TP, PP stages: each rank's
    own), with the HF Llama in `directory`; a collective over the default process group.
    Weights in bfloat16 or float16 are widened to the model's dtype as they are copied."""
    hf = read_hf_model(directory)
    check_matches(hf, whole_shapes(args), args)
    state = get_model_state_dict(model)
    ours = whole_shapes(args)
    loaded = {name: tensor for name, tensor in state.items() if name in ours}
    heads = {hf_name(name): args.head_dim for name in loaded if rope_permuted(name)}
    # A tied model's one tensor goes into two of ours: the output in a second pass (each rank
    # still reads only its own shard of it, in whatever layout the output has).
    second = {OUTPUT: loaded.pop(OUTPUT)} if hf.tied and OUTPUT in loaded else {}
    for part in (loaded, second) if hf.tied else (loaded,):
        reader = RopeReorderingReader(str(directory), heads)
        dcp.load({hf.source(name): tensor for name, tensor in part.items()}, storage_reader=reader)
    set_model_state_dict(model, state)
