"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU or MoE.

Blocks live in a ModuleDict keyed by their index (as in TorchTitan) so that a pipeline split can
keep a subset of blocks by name and checkpoint keys stay the same whatever the parallel layout.
The attention kernel is a replaceable submodule (`Attention.core`) so that context parallelism can
swap in ring attention without touching the projections around it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer.model.init import init_parameters
from trainer.model.moe import MoE, MoEArgs


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary scaling for long context: frequencies whose wavelength is longer than
    `original_max_len / low_freq_factor` are divided by `factor`, those shorter than
    `original_max_len / high_freq_factor` kept, and a smooth ramp between."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    def __post_init__(self) -> None:
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"rope_high_freq_factor {self.high_freq_factor} must be above "
                f"rope_low_freq_factor {self.low_freq_factor}"
            )

    def scaled(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """`inv_freq` scaled, in the very operations of transformers' llama3 rope (so that an
        imported Llama 3.1 computes its tables bit for bit)."""
        low_wavelen = self.original_max_len / self.low_freq_factor
        high_wavelen = self.original_max_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        out = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * out / self.factor + smooth * out
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, out)


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    ffn_multiple_of: int = 32
    # Llama 3's ffn_dim_multiplier: scales the SwiGLU hidden size before the rounding.
    ffn_dim_multiplier: float | None = None
    max_seq_len: int = 1024
    rope_theta: float = 10_000.0
    # None: plain RoPE; else Llama 3.1's scaling of its frequencies.
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    # None: every block has a dense SwiGLU feed-forward; else every block has this MoE instead.
    moe: MoEArgs | None = None

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """SwiGLU hidden size: 2/3 of 4*dim, times ffn_dim_multiplier, rounded up to a multiple
        (Llama's rule: 14336 for the 8B shape)."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.ffn_multiple_of * math.ceil(hidden / self.ffn_multiple_of)


def rope_frequencies(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """The rotary frequencies of a head's dimension pairs (head_dim // 2), scaled as the model
    says (Llama 3.1's `RopeScaling`)."""
    half = args.head_dim // 2
    exponents = torch.arange(0, half, dtype=torch.float32, device=device) / half
    inv_freq = 1.0 / (args.rope_theta**exponents)
    if args.rope_scaling is not None:
        inv_freq = args.rope_scaling.scaled(inv_freq)
    return inv_freq


def rope_tables(
    args: ModelArgs, positions: torch.Tensor | None = None, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables of shape (len(positions), head_dim // 2), on `device`.

    `positions` (default: every one up to max_seq_len) are the sequence positions the model is
    fed, in order: context parallelism feeds each rank only some of them.
    """
    inv_freq = rope_frequencies(args, device)
    if positions is None:
        positions = torch.arange(args.max_seq_len, device=device)
    angles = torch.outer(positions.to(device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (batch, seq, heads, head_dim) by position-dependent angles.

    The tables are (positions, head_dim // 2), the same for every sequence, or (batch, seq,
    head_dim // 2) for positions of each token of its own (`document_layout`)."""
    seq = x.shape[1]
    if cos.dim() == 2:
        cos, sin = cos[:seq].view(1, seq, 1, -1), sin[:seq].view(1, seq, 1, -1)
    else:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2)


def document_layout(tokens: torch.Tensor, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each token of packed windows (batch, seq) stands in its document, and which keys
    each query may attend to (batch, 1, seq, seq): the earlier tokens of its own document.

    A window packs whole documents, each ended by `eos` (which belongs to the document it ends),
    so the documents are read off the tokens themselves. Without the mask a document's tokens
    would attend to unrelated text packed before it, and without the restarted positions its
    first token would look like the middle of a sequence."""
    seq = tokens.shape[1]
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == eos
    document = starts.cumsum(1)
    index = torch.arange(seq, device=tokens.device).expand_as(tokens)
    first = torch.where(starts, index, 0).cummax(1).values
    causal = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).tril()
    same = document.unsqueeze(2) == document.unsqueeze(1)
    return index - first, (same & causal).unsqueeze(1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class CausalAttention(nn.Module):
    """Causal attention over the whole (local) sequence with PyTorch's fused kernel.

    Takes q as (batch, heads, seq, head_dim) and k, v with the (fewer) key/value heads: keeping
    the grouped heads unexpanded until here lets ring attention pass the smaller k, v around.
    `mask` (batch, 1, seq, seq), when given, replaces the causal mask (`document_layout`).
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        repeats = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.core: nn.Module = CausalAttention()

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        # Head counts come from the projections' (possibly tensor-parallel, local) widths.
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        qkv = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = self.core(*qkv) if mask is None else self.core(*qkv, mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward: nn.Module = (
            MoE(args.dim, args.ffn_dim, args.moe) if args.moe else FeedForward(args)
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The whole model, or a pipeline stage of it.

    A stage holds a subset of `layers` (keys unchanged) and has `tok_embeddings` only if it is the
    first stage and `norm`/`output` only if it is the last; the others are None. `forward` then
    takes token ids or hidden states and returns logits or hidden states accordingly.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        # The positions the rotary tables cover (None: all); context parallelism sets them.
        self.rope_positions: torch.Tensor | None = None
        # Document masking (`document_layout`): the end-of-document token; None: off.
        self.document_eos: int | None = None
        cos, sin = rope_tables(args)
        # Derived from the config, so not part of the checkpoint.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @classmethod
    def sharing(cls, model: Transformer, layers: list[str], first: bool, last: bool) -> Transformer:
        """A pipeline stage made of `model`'s own modules (no copy): blocks `layers`, plus the
        embedding if `first` and the final norm and output if `last`."""
        stage = cls.__new__(cls)
        nn.Module.__init__(stage)
        stage.args = model.args
        stage.tok_embeddings = model.tok_embeddings if first else None
        stage.layers = nn.ModuleDict({key: model.layers[key] for key in layers})
        stage.norm = model.norm if last else None
        stage.output = model.output if last else None
        stage.rope_positions = model.rope_positions
        stage.document_eos = None  # refused with pipeline parallelism (ParallelDims.check)
        stage.register_buffer("rope_cos", model.rope_cos, persistent=False)
        stage.register_buffer("rope_sin", model.rope_sin, persistent=False)
        return stage

    def set_rope_positions(self, positions: torch.Tensor) -> None:
        """Feed this model only `positions` of each sequence: rotary tables for those alone."""
        self.rope_positions = positions
        self.init_buffers(self.rope_cos.device)

    def init_weights(self, seed: int) -> None:
        """Initialise the parameters, whole or this rank's shards of them (trainer.model.init:
        every layout gets the values one process gets from the same seed), and the buffers."""
        init_parameters(self, seed, self.args.n_layers)
        self.init_buffers(self.rope_cos.device)

    def init_buffers(self, device: torch.device) -> None:
        """Compute the buffers on `device`: rotary tables, zeroed MoE balancing state."""
        self.rope_cos, self.rope_sin = rope_tables(self.args, self.rope_positions, device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.init_buffers()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin, mask = self.rope_cos, self.rope_sin, None
        if self.document_eos is not None:
            positions, mask = document_layout(x, self.document_eos)
            cos, sin = cos[positions], sin[positions]
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def num_params(self, exclude_embedding: bool = True) -> int:
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            total -= self.tok_embeddings.weight.numel()
        return total

    def active_params(self) -> int:
        """The parameters a token computes with, the embedding excluded: the N of MFU's 6N. A
        dense model's all; an MoE's routed experts count for the top_k of n_experts a token is
        sent to (DeepSeek-V3: 37B of 671B), else MFU would credit the run with the idle ones."""
        idle = 0.0
        for block in self.layers.values():
            moe = getattr(block, "feed_forward", None)
            if isinstance(moe, MoE):
                experts = sum(p.numel() for p in moe.experts.parameters())
                idle += experts * (1 - moe.args.top_k / moe.args.n_experts)
        return self.num_params() - round(idle)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position, computed in fp32.

    Under tensor parallelism the logits are sharded over the vocabulary and this runs inside
    `loss_parallel`, which makes the same call vocabulary-parallel.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
