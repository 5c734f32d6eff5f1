"""Model presets have the published Llama 3 shapes: parameter counts from a meta-device build
(no memory) within 1% of the published ones, FFN sizes by Llama's rounding, which every FP8
recipe's blocks divide."""

from __future__ import annotations

import pytest
import torch

from trainer import options
from trainer.config import from_values
from trainer.model.llama import Transformer
from trainer.model.presets import PRESETS, PUBLISHED_PARAMS


def model_args(name: str):
    return from_values(options.resolve({"run_id": "r", "preset": name})).model


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_llama3_presets_have_the_published_parameter_count_within_one_percent(name: str) -> None:
    with torch.device("meta"):
        model = Transformer(model_args(name))
    count = model.num_params(exclude_embedding=False)
    assert abs(count / PUBLISHED_PARAMS[name] - 1) < 0.01, f"{name}: {count:,}"


def test_llama3_ffn_sizes_follow_the_published_rounding() -> None:
    sizes = {name: model_args(name).ffn_dim for name in ("llama3-1b", "llama3-8b", "llama3-70b",
                                                         "llama3-405b")}  # fmt: skip
    assert sizes == {"llama3-1b": 8192, "llama3-8b": 14336, "llama3-70b": 28672,
                     "llama3-405b": 53248}  # fmt: skip


@pytest.mark.parametrize("name", [n for n in PRESETS if n not in ("debug", "moe-small")])
def test_every_large_preset_splits_into_every_fp8_recipes_blocks(name: str) -> None:
    args = model_args(name)
    widths = {args.dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim}
    widths.add(args.moe.hidden if args.moe else args.ffn_dim)
    assert all(width % 128 == 0 for width in widths), widths


def test_explicit_options_override_a_preset() -> None:
    job = options.resolve({"run_id": "r", "preset": "llama3-70b", "n_layers": 2})
    args = from_values(job).model
    assert (args.dim, args.n_layers, args.n_kv_heads, args.rope_theta) == (8192, 2, 8, 500_000.0)
