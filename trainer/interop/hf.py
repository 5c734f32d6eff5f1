"""Our Llama's parameter names, layouts and config beside Hugging Face's `LlamaForCausalLM`: the
one mapping that export (`trainer.interop.hf_export`) and import (`trainer.interop.hf_import`)
share, and the checks of an HF directory, each failing in one line that names the problem.

Names: `layers.3.attention.wq.weight` is HF's `model.layers.3.self_attn.q_proj.weight`, and so
on (`hf_name`). Values are the same tensors, except the rows of `wq` and `wk` (`rope_order`).

Pure Python but for `rope_order`: `scaletrain run` checks an HF directory against the job before
it starts anything, without importing torch.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaletrain.errors import UserError

if TYPE_CHECKING:
    import torch

    from trainer.model.llama import ModelArgs

ARCHITECTURE = "LlamaForCausalLM"
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_SUFFIX = ".safetensors"
# transformers' own default largest shard (`save_pretrained(max_shard_size="5GB")`).
DEFAULT_SHARD_BYTES = 5 * 10**9

# Our embedding and output projection (which a tied HF model shares).
EMBEDDING, OUTPUT = "tok_embeddings.weight", "output.weight"
_TOP = {
    EMBEDDING: "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    OUTPUT: "lm_head.weight",
}
_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
# Our tensors whose rows the two RoPE conventions order differently.
ROPE_PERMUTED = ("attention.wq.weight", "attention.wk.weight")
# The floating dtypes an HF checkpoint may hold (safetensors' names) and what they are called here.
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def hf_name(name: str) -> str:
    """HF's name of our parameter `name` (a key of `Transformer.state_dict()`)."""
    if name in _TOP:
        return _TOP[name]
    match = _LAYER.fullmatch(name)
    if match is None or match.group(2) not in _BLOCK:
        raise UserError(f"{name}: no Hugging Face Llama parameter corresponds to it")
    return f"model.layers.{match.group(1)}.{_BLOCK[match.group(2)]}"


def rope_permuted(name: str) -> bool:
    """Whether our parameter `name` is stored with its rows in another order in HF's layout."""
    return name.endswith(ROPE_PERMUTED)


def rope_order(rows: int, head_dim: int, to_hf: bool) -> torch.Tensor:
    """Row indices that reorder a `wq` or `wk` weight (`rows` = heads x head_dim) between the
    two conventions of rotary embeddings: `w[rope_order(..., to_hf=True)]` is HF's layout of our
    weight `w`, and `w_hf[rope_order(..., to_hf=False)]` ours of HF's `w_hf`.

    Why: we rotate adjacent channel pairs (2i, 2i+1) of each head by the i-th frequency (Meta's
    original Llama, `trainer.model.llama.apply_rope`); `transformers` rotates the pairs
    (i, i + head_dim/2) (`rotate_half`). Attention scores only see q.k within a head, so
    reordering the output rows of `wq` and `wk` the same way inside every head turns one
    convention into the other exactly: HF's row i of a head is our row 2i, its row
    head_dim/2 + i our row 2i + 1. That is the permutation of HF's own
    `convert_llama_weights_to_hf.py`. `wv`, `wo` and the rest need none: the value and output
    projections never meet the rotation.
    """
    import torch

    half = head_dim // 2
    index = torch.arange(rows)
    head, within = index // head_dim, index % head_dim
    if to_hf:  # HF row (h, j*half + i) takes our row (h, 2i + j)
        return head * head_dim + 2 * (within % half) + within // half
    # our row (h, 2i + j) takes HF row (h, j*half + i)
    return head * head_dim + (within % 2) * half + within // 2


def hf_config(args: ModelArgs, dtype: str, tokens: dict[str, int | None]) -> dict[str, Any]:
    """`config.json` of `LlamaForCausalLM` for our dense model `args`, weights in `dtype`
    (`torch_dtype` name) and the tokenizer's special ids `tokens` (eos/pad/bos_token_id)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        # transformers 5 reads `rope_parameters`, earlier versions `rope_theta` and
        # `rope_scaling`: both.
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta}
        | _hf_rope_scaling(args),
        "rope_scaling": _hf_rope_scaling(args) or None,
        "rms_norm_eps": args.norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,  # `dtype` in transformers 5
        "dtype": dtype,
        **tokens,
    }


def _hf_rope_scaling(args: ModelArgs) -> dict[str, Any]:
    """Llama 3.1's `rope_scaling` for `args` (empty for plain RoPE)."""
    scaling = args.rope_scaling
    if scaling is None:
        return {}
    return {
        "rope_type": LLAMA3_ROPE,
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_len,
    }


# What an HF config must say for our Llama to compute the same function, and what we take instead.
_REQUIRED: dict[str, tuple[object, ...]] = {
    "hidden_act": ("silu",),
    "attention_bias": (False, None),
    "mlp_bias": (False, None),
    # transformers 5's rope_parameters["rope_type"], or the rope_scaling of earlier versions.
    "rope_type": ("default", None, "llama3"),
}
# The one rotary scaling our Llama has: Llama 3.1's.
LLAMA3_ROPE = "llama3"


@dataclass(frozen=True)
class HFModel:
    """An HF Llama directory, checked: its config and each tensor's shape and dtype (safetensors
    headers only; no tensor is read)."""

    directory: Path
    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    dtype: str  # safetensors' name, one for every tensor

    @property
    def tied(self) -> bool:
        """Whether the output projection is the embedding (Llama 3.2 1B and 3B): the file then
        holds no lm_head, and our (untied) output starts as a copy of the embedding."""
        return bool(self.config.get("tie_word_embeddings"))

    def source(self, name: str) -> str:
        """The HF tensor our parameter `name` is loaded from."""
        if self.tied and name == OUTPUT:
            return hf_name(EMBEDDING)
        return hf_name(name)

    @property
    def options(self) -> dict[str, int | float]:
        """The values of our model options (trainer.options) that give this model's shapes."""
        c = self.config
        dim, intermediate = int(c["hidden_size"]), int(c["intermediate_size"])
        hidden = int(2 * 4 * dim / 3)
        return {
            "dim": dim,
            "n_layers": int(c["num_hidden_layers"]),
            "n_heads": int(c["num_attention_heads"]),
            "n_kv_heads": int(c.get("num_key_value_heads") or c["num_attention_heads"]),
            "vocab_size": int(c["vocab_size"]),
            # Rounding to a multiple of the hidden size itself gives exactly that size.
            "multiple_of": intermediate,
            "ffn_dim_multiplier": 0.0 if hidden <= intermediate else intermediate / hidden,
            "rope_theta": float(_rope(c).get("rope_theta", 10_000.0)),
            **_rope_scaling_options(c),
            "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
        }


def _rope_scaling(config: dict[str, Any]) -> dict[str, Any]:
    """The rotary scaling of an HF config (empty for none): `rope_scaling` (transformers 4 and
    the published Llama 3.1 configs), else `rope_parameters` of a type other than default."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or (
        params if params.get("rope_type", "default") != "default" else {}
    )
    return dict(scaling)


def _rope_scaling_options(config: dict[str, Any]) -> dict[str, int | float]:
    """Our rope options for the HF config's scaling (plain RoPE: rope_scaling 0)."""
    scaling = _rope_scaling(config)
    if not scaling:
        return {"rope_scaling": 0.0}
    return {
        "rope_scaling": float(scaling["factor"]),
        "rope_low_freq_factor": float(scaling.get("low_freq_factor", 1.0)),
        "rope_high_freq_factor": float(scaling.get("high_freq_factor", 4.0)),
        "rope_original_max_len": int(scaling.get("original_max_position_embeddings", 8192)),
    }


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings of an HF config: `rope_parameters` (transformers 5), else the
    top-level keys of earlier versions."""
    return config.get("rope_parameters") or config


def read_hf_model(directory: Path, flag: str = "--init-from-hf") -> HFModel:
    """The HF Llama in `directory`, or UserError in one line: no directory or `config.json`, an
    architecture other than `LlamaForCausalLM` or a setting we cannot map, no safetensors
    weights, or weights that are not all of one floating dtype."""
    where = f"{flag} {directory}"
    if not directory.is_dir():
        raise UserError(f"{where}: no such directory")
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise UserError(f"{where}: no {CONFIG_FILE} (not a Hugging Face model directory)") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{where}/{CONFIG_FILE}: unreadable ({exc})") from None
    architectures = config.get("architectures") or [config.get("model_type", "?")]
    if architectures != [ARCHITECTURE] or config.get("model_type", "llama") != "llama":
        raise UserError(
            f"{where}: architecture {', '.join(map(str, architectures))} cannot be mapped; "
            f"this trainer's model is a {ARCHITECTURE}"
        )
    scaling = _rope_scaling(config)
    rope_type = scaling.get("rope_type", scaling.get("type")) if scaling else None
    settings = config | {"rope_type": rope_type}
    for key, allowed in _REQUIRED.items():
        if settings.get(key) not in allowed:
            raise UserError(
                f"{where}/{CONFIG_FILE}: {key} = {json.dumps(settings.get(key))} cannot be "
                f"mapped; this trainer's Llama has {key} = {json.dumps(allowed[0])}"
            )
    heads, dim = config.get("num_attention_heads"), config.get("hidden_size")
    if config.get("head_dim") not in (None, dim // heads if dim and heads else None):
        raise UserError(f"{where}/{CONFIG_FILE}: head_dim {config['head_dim']} != hidden_size / "
                        "num_attention_heads, which this trainer's Llama requires")  # fmt: skip
    shapes, dtypes = _headers(directory, where)
    odd = {name: dtype for name, dtype in dtypes.items() if dtype not in FLOAT_DTYPES}
    if odd:
        name, dtype = next(iter(sorted(odd.items())))
        raise UserError(f"{where}: {name} is {dtype}; only float32, bfloat16 or float16 weights "
                        "load (a quantized checkpoint does not)")  # fmt: skip
    if len(set(dtypes.values())) > 1:
        found = ", ".join(sorted(FLOAT_DTYPES[d] for d in set(dtypes.values())))
        raise UserError(f"{where}: the weights mix dtypes ({found}); expected one")
    dtype = next(iter(dtypes.values()))
    declared = config.get("torch_dtype") or config.get("dtype")
    if declared and declared != FLOAT_DTYPES[dtype]:
        raise UserError(
            f"{where}: {CONFIG_FILE} says torch_dtype {declared}, the weights are "
            f"{FLOAT_DTYPES[dtype]}"
        )
    return HFModel(directory, config, shapes, dtype)


def _headers(directory: Path, where: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Every tensor's shape and dtype from the safetensors files' headers (8 bytes of length,
    then JSON: the format's own definition)."""
    files = sorted(directory.glob(f"*{SAFETENSORS_SUFFIX}"))
    if not files:
        raise UserError(f"{where}: no {SAFETENSORS_SUFFIX} weights")
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for path in files:
        try:
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, struct.error, ValueError) as exc:
            raise UserError(f"{where}: {path.name} is not a safetensors file ({exc})") from None
        for name, entry in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(entry["shape"])
                dtypes[name] = entry["dtype"]
    return shapes, dtypes


# The options that size each of our tensors, by the end of its name: what a mismatch names.
_SIZED_BY = {
    "tok_embeddings.weight": ("vocab_size", "dim"),
    "output.weight": ("vocab_size", "dim"),
    "attention.wq.weight": ("dim", "n_heads"),
    "attention.wo.weight": ("dim", "n_heads"),
    "attention.wk.weight": ("dim", "n_heads", "n_kv_heads"),
    "attention.wv.weight": ("dim", "n_heads", "n_kv_heads"),
    "feed_forward.w1.weight": ("dim", "multiple_of", "ffn_dim_multiplier"),
    "feed_forward.w2.weight": ("dim", "multiple_of", "ffn_dim_multiplier"),
    "feed_forward.w3.weight": ("dim", "multiple_of", "ffn_dim_multiplier"),
    "norm.weight": ("dim",),
}


def _flags(values: dict[str, int | float]) -> str:
    return " ".join(f"--{dest.replace('_', '-')} {value:g}" for dest, value in values.items())


def check_matches(model: HFModel, ours: dict[str, tuple[int, ...]], args: ModelArgs) -> None:
    """Refuse, in one line naming the tensor, both shapes and the options that fix it, an HF
    model whose tensors do not have our model's shapes (`ours`: our name -> full shape), or
    whose heads, rotary base or norm epsilon differ (equal shapes, another function)."""
    if args.moe is not None:
        raise UserError(f"--init-from-hf loads a dense {ARCHITECTURE}; this run's model has "
                        f"--n-experts {args.moe.n_experts} (set --n-experts 0)")  # fmt: skip
    wanted = model.options
    layers = wanted["n_layers"]
    if layers != args.n_layers:
        raise UserError(f"--init-from-hf {model.directory}: the HF model has {layers} layers, "
                        f"this run's model {args.n_layers}; set --n-layers {layers}")  # fmt: skip
    for name, shape in ours.items():
        theirs = model.shapes.get(model.source(name))
        if theirs == shape:
            continue
        fix = next((d for suffix, d in _SIZED_BY.items() if name.endswith(suffix)), ("dim",))
        found = "missing" if theirs is None else "x".join(map(str, theirs))
        raise UserError(
            f"--init-from-hf {model.directory}: {model.source(name)} is {found}, this run's "
            f"{name} is {'x'.join(map(str, shape))}; set "
            f"{_flags({d: wanted[d] for d in fix})}"
        )
    scaling = args.rope_scaling
    actual = {
        "n_heads": args.n_heads,
        "rope_theta": args.rope_theta,
        "norm_eps": args.norm_eps,
        "rope_scaling": scaling.factor if scaling else 0.0,
    }
    if scaling and wanted["rope_scaling"]:
        actual |= {
            "rope_low_freq_factor": scaling.low_freq_factor,
            "rope_high_freq_factor": scaling.high_freq_factor,
            "rope_original_max_len": scaling.original_max_len,
        }
    for dest, value in actual.items():
        if not math.isclose(value, wanted[dest], rel_tol=1e-9):
            raise UserError(
                f"--init-from-hf {model.directory}: its {dest.replace('_', '-')} is "
                f"{wanted[dest]:g}, this run's {value:g}; set {_flags({dest: wanted[dest]})}"
            )
