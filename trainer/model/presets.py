"""Named model shapes (`--preset NAME`): the published Llama 3 sizes, a debug model and two MoEs.

Plain data, no torch, so that `scaletrain run` and `scaletrain plan` resolve a preset without
loading it. Each preset gives the values of the model options (trainer/options.py, section
[model]); explicit options override them. FFN sizes follow Llama's rounding: the SwiGLU hidden
size is 2/3 of 4*dim, times `ffn_dim_multiplier`, rounded up to `multiple_of` (1024 or 4096 on
the large models), which every FP8 recipe's 128-blocks divide.

Sources: Llama 3 (arXiv 2407.21783, table 3) and Llama 3.2 1B; DeepSeek-V3 (arXiv 2412.19437).
Deliberate differences, because this model is one Llama-style decoder: output head untied (Llama
3.2 1B ties it, 1.24B published, 1.50B here), and the DeepSeek-V3-like preset has grouped-query
attention instead of MLA and an MoE in every block (DeepSeek-V3 keeps its first three dense).
"""

from __future__ import annotations

# Published total parameter counts, which the tests hold the meta-device builds to.
PUBLISHED_PARAMS = {"llama3-8b": 8.03e9, "llama3-70b": 70.6e9, "llama3-405b": 405.9e9}

_LLAMA3 = {"vocab_size": 128_256, "rope_theta": 500_000.0, "max_seq_len": 8192, "norm_eps": 1e-5}

PRESETS: dict[str, dict[str, object]] = {
    # The trainer's default model: byte vocabulary, small enough for a CPU test in seconds.
    "debug": {
        "dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256,
        "multiple_of": 32, "ffn_dim_multiplier": 0.0, "rope_theta": 10_000.0,
        "max_seq_len": 1024, "norm_eps": 1e-5, "n_experts": 0,
    },
    "llama3-1b": _LLAMA3 | {
        "dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "multiple_of": 256,
        "ffn_dim_multiplier": 1.5, "n_experts": 0,
    },
    "llama3-8b": _LLAMA3 | {
        "dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "multiple_of": 1024,
        "ffn_dim_multiplier": 1.3, "n_experts": 0,
    },
    "llama3-70b": _LLAMA3 | {
        "dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8, "multiple_of": 4096,
        "ffn_dim_multiplier": 1.3, "n_experts": 0,
    },
    "llama3-405b": _LLAMA3 | {
        "dim": 16384, "n_layers": 126, "n_heads": 128, "n_kv_heads": 8, "multiple_of": 4096,
        "ffn_dim_multiplier": 1.2, "n_experts": 0,
    },
    # A small MoE for CPU runs: 8 experts, top 2, one shared expert.
    "moe-small": {
        "dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 256,
        "multiple_of": 128, "ffn_dim_multiplier": 0.0, "rope_theta": 10_000.0,
        "max_seq_len": 1024, "norm_eps": 1e-5, "n_experts": 8, "top_k": 2,
        "shared_experts": 1, "moe_hidden": 256, "expert_groups": 1, "topk_groups": 1,
    },
    # DeepSeek-V3's routed MoE: 256 experts of hidden 2048, top 8 from 4 of 8 groups, 1 shared.
    "deepseek-v3-like": {
        "dim": 7168, "n_layers": 61, "n_heads": 128, "n_kv_heads": 128, "vocab_size": 129_280,
        "multiple_of": 256, "ffn_dim_multiplier": 0.0, "rope_theta": 10_000.0,
        "max_seq_len": 4096, "norm_eps": 1e-6, "n_experts": 256, "top_k": 8,
        "shared_experts": 1, "moe_hidden": 2048, "expert_groups": 8, "topk_groups": 4,
    },
}  # fmt: skip


def preset(name: str) -> dict[str, object]:
    """The option values of preset `name`; ValueError listing the names if there is none."""
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r} is not a preset; presets: {', '.join(PRESETS)}")
    return PRESETS[name]
