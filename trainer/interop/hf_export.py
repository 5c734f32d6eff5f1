"""A checkpoint's model as a Hugging Face directory that `LlamaForCausalLM.from_pretrained` loads.

Reads only the model's tensors (not the optimizer's) through any DCP storage reader, so it runs
straight from ckptd's tiers (`CkptdStorageReader`, whose reads check every block's CRC-32C), maps
names and the RoPE row order (`trainer.interop.hf`), and writes safetensors shards with their
index through DCP's own `HuggingFaceStorageWriter`; then `config.json` and the tokenizer files.
The model's shape comes from the job config every checkpoint keeps (`train.config`).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from scaletrain.errors import UserError
from trainer import options
from trainer.config import TrainConfig, from_values
from trainer.interop.hf import (
    CONFIG_FILE,
    DEFAULT_SHARD_BYTES,
    hf_config,
    hf_name,
    rope_order,
    rope_permuted,
)
from trainer.interop.hf_tokenizer import special_ids, write_tokenizer
from trainer.model.llama import ModelArgs

MODEL_PREFIX = "model."


@dataclass(frozen=True)
class Exported:
    """What an export wrote: the safetensors shards, every other file, and the bytes of weights."""

    shards: list[str]
    files: list[str]
    weight_bytes: int


def saved_job(reader: StorageReader) -> TrainConfig:
    """The job the checkpoint was saved by (its `train.config`), which sizes its model."""
    metadata = reader.read_metadata()
    if "train.config" not in metadata.state_dict_metadata:
        raise UserError("the checkpoint keeps no job config (saved before checkpoints did), so "
                        "its model's shape is unknown")  # fmt: skip
    state = {"train": {"config": ""}}
    with _one_process():
        dcp.load(state, storage_reader=reader, no_dist=True)
    # Options added since the checkpoint was saved take their defaults.
    defaults = {o.dest: o.default for o in options.OPTIONS}
    return from_values(defaults | options.from_toml(state["train"]["config"]))


def refuse_moe(args: ModelArgs) -> None:
    """An MoE has no `transformers` class of the same function and layout: say what differs from
    the closest, `MixtralForCausalLM` (softmax top-k routing renormalised over the chosen
    experts, Llama attention)."""
    moe = args.moe
    if moe is None:
        return
    differs = [
        what
        for what, present in (
            (f"{moe.n_shared} shared expert(s) (Mixtral has none)", moe.n_shared > 0),
            ("the aux-free bias in expert choice", moe.balance == "aux_free"),
            (f"group-limited routing ({moe.n_groups} groups)", moe.n_groups > 1),
            ("capacity dropping", moe.capacity_factor > 0),
            ("top-1 gates not renormalised", moe.top_k == 1),
        )
        if present
    ]
    differs.append("experts stored as (experts, dim, hidden) tensors, which this export does not "
                   "split into Mixtral's per-expert linears")  # fmt: skip
    raise UserError("cannot export an MoE model to Hugging Face: the closest class, "
                    f"MixtralForCausalLM, differs in {'; '.join(differs)}")  # fmt: skip


def export_hf(
    reader: StorageReader, out: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES
) -> Exported:
    """Write the checkpoint `reader` reads as an HF Llama directory into the empty `out`."""
    job = saved_job(reader)
    args = job.model
    refuse_moe(args)
    tokens = special_ids(job.data)  # before any weight is read: refuses a missing tokenizer
    metadata = reader.read_metadata().state_dict_metadata
    tensors = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)
    }
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1:
        raise UserError(f"the checkpoint's model mixes dtypes ({', '.join(map(str, dtypes))})")
    with _one_process():
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    hf_state = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(MODEL_PREFIX)
        if rope_permuted(name):
            tensor = tensor[rope_order(tensor.shape[0], args.head_dim, to_hf=True)]
        hf_state[hf_name(name)] = tensor
    shard_of = _shards(hf_state, max_shard_bytes)
    writer = HuggingFaceStorageWriter(
        str(out), fqn_to_index_mapping=shard_of, thread_count=min(4, max(shard_of.values()))
    )
    # No fsync per shard (FileSystemWriter's default), as the stock DCP export: an export is
    # a copy that can be made again, and the fsync cost a fifth of its time here.
    writer.sync_files = False
    with _one_process():
        dcp.save(hf_state, storage_writer=writer, no_dist=True)
    dtype = str(dtypes.pop()).removeprefix("torch.")
    config = hf_config(args, dtype, tokens)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    files = [CONFIG_FILE, *write_tokenizer(job.data, out, args.max_seq_len)]
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    weight_bytes = sum(t.numel() * t.element_size() for t in hf_state.values())
    return Exported(shards, files, weight_bytes)


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> dict[str, int]:
    """Each tensor's shard (1..N), in order, a new shard once one would pass `max_bytes` (a
    tensor larger than that gets one of its own), as `save_pretrained` cuts them."""
    shard_of, index, filled = {}, 1, 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if filled and filled + size > max_bytes:
            index, filled = index + 1, 0
        shard_of[name] = index
        filled += size
    return shard_of


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """DCP in this one process (no_dist=True), without the UserWarning torch 2.13 gives for it
    even when asked: an export is one process by design, and the warning is noise to a user."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        yield
